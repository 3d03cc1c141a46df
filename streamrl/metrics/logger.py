"""One place where metrics leave the program: console line, JSONL file, tensorboard, wandb, mlflow.

Components return metrics as flat dicts with namespaced keys (``gen/tokens_per_s``,
``train/step_s``, ``reward/mean``); the controller hands each iteration's dict to ``log``.
wandb and mlflow are optional extras (``pip install 'streamrl[wandb]'`` / ``'streamrl[mlflow]'``):
they are imported only when chosen, so this module stays cheap to import, and ``check_backends``
lets the driver fail on a missing package before any work starts. Both write under ``out_dir``
and need no network unless the user's environment points them at a server (``WANDB_MODE``,
``MLFLOW_TRACKING_URI``).
"""

from __future__ import annotations

import importlib.util
import json
import math
import numbers
import os
import re
import time
from pathlib import Path
from typing import Any, Iterable

CONSOLE_KEYS = (
    ("reward/mean", "reward", "{:.3f}"),
    ("reward/accuracy", "acc", "{:.3f}"),
    ("resp_len/p50", "len50", "{:.0f}"),
    ("resp_len/p90", "len90", "{:.0f}"),
    ("resp_len/max", "lenmax", "{:.0f}"),
    ("gen/tokens_per_s", "gen_tok/s", "{:.0f}"),
    ("train/tokens_per_s", "train_tok/s", "{:.0f}"),
    ("time/gen_s", "gen_s", "{:.1f}"),
    ("time/train_s", "train_s", "{:.1f}"),
    ("time/step_s", "step_s", "{:.1f}"),
    ("eval/accuracy", "eval_acc", "{:.3f}"),
)

BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
# backend -> (top-level package it imports, the install command that brings it)
_OPTIONAL = {
    "wandb": ("wandb", "pip install 'streamrl[wandb]'"),
    "mlflow": ("mlflow", "pip install 'streamrl[mlflow]'"),
}


def check_backends(backends: Iterable[str]) -> None:
    """Raise ``ValueError`` (one line) for an unknown backend or one whose package is missing.

    Cheap: looks the packages up with ``importlib.util.find_spec`` and imports none of them."""
    for name in backends:
        if name not in BACKENDS:
            raise ValueError(f"unknown logging backend {name!r}; known: {', '.join(BACKENDS)}")
        if name in _OPTIONAL:
            package, install = _OPTIONAL[name]
            try:
                found = importlib.util.find_spec(package) is not None
            except (ImportError, ValueError):  # a broken install or a module without __spec__
                found = False
            if not found:
                raise ValueError(f"logging backend {name!r} needs the {package} package, which is not "
                                 f"installed: {install}")


def console_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"iter {step:4d}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The metrics that are finite real numbers (numpy scalars included, bools not), as floats."""
    out = {}
    for key, value in metrics.items():
        if isinstance(value, numbers.Real) and not isinstance(value, bool):
            value = float(value)
            if math.isfinite(value):
                out[key] = value
    return out


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``; lists and empty dicts stay leaves."""
    if not isinstance(tree, dict) or (not tree and prefix):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _run_identity(out_dir: Path, config) -> tuple[str, str]:
    """(project, run name): ``config.logging.project`` / ``.run_name``, else streamrl / out_dir's name."""
    logging_cfg = getattr(config, "logging", None)
    project = getattr(logging_cfg, "project", None) or "streamrl"
    run_name = getattr(logging_cfg, "run_name", None) or out_dir.resolve().name
    return project, run_name


def _config_dict(config) -> dict[str, Any] | None:
    if config is None:
        return None
    if hasattr(config, "model_dump"):
        return config.model_dump(mode="json")
    return dict(config)


class _Wandb:
    """A wandb run in ``out_dir/wandb``: offline unless ``WANDB_MODE`` says otherwise.

    Steps: wandb drops a ``log(..., step=s)`` whose ``s`` is below a step it has already seen, and
    the driver does log out of order (stream-async reports iteration k's training metrics after
    iteration k+1's row, with ``echo=False``). So no ``step=`` is passed: wandb's own ``_step``
    just counts rows and never goes backwards, and every row carries ``iteration`` (our step),
    declared as the x-axis of every metric with ``define_metric``. Late rows are kept and plot at
    their iteration."""

    STEP_KEY = "iteration"

    def __init__(self, out_dir: Path, config) -> None:
        import wandb

        project, run_name = _run_identity(out_dir, config)
        self.run = wandb.init(
            project=project, name=run_name, dir=str(out_dir), config=_config_dict(config),
            mode=os.environ.get("WANDB_MODE", "offline"),
            reinit="create_new",  # a second logger in this process gets its own run (wandb>=0.19.10)
        )
        self.run.define_metric(self.STEP_KEY)
        self.run.define_metric("*", step_metric=self.STEP_KEY)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = _scalars(metrics)
        if scalars:
            self.run.log({**scalars, self.STEP_KEY: step})

    def close(self) -> None:
        self.run.finish()


# mlflow's allowed name characters, minus the colon (not allowed on Windows)
_MLFLOW_BAD_CHARS = re.compile(r"[^\w\-. /]")


def _mlflow_key(key: str, limit: int) -> str:
    """A metric/param name mlflow accepts: allowed characters only, and a normalised path (no empty,
    ``.`` or ``..`` segments, no leading or trailing slash)."""
    key = _MLFLOW_BAD_CHARS.sub("_", str(key))[:limit]
    parts = [p.replace(".", "_") if p in (".", "..") else p for p in key.split("/") if p]
    return "/".join(parts) or "_"


class _Mlflow:
    """An mlflow run via ``MlflowClient`` (no global state: two loggers in one process stay apart).

    The store is ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<out_dir>/mlflow.db`` with
    artifacts in ``out_dir/mlartifacts``: mlflow 3 refuses the ``./mlruns`` file store unless
    ``MLFLOW_ALLOW_FILE_STORE=true`` (it is in maintenance mode), and sqlite needs no server and no
    network. Browse it with ``mlflow ui --backend-store-uri sqlite:///<out_dir>/mlflow.db``."""

    def __init__(self, out_dir: Path, config) -> None:
        os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")  # a run sends nothing anywhere unasked
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        try:
            from mlflow.utils.validation import MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH
        except ImportError:  # older layouts: the most conservative limits mlflow ever had
            MAX_ENTITY_KEY_LENGTH, MAX_PARAM_VAL_LENGTH = 250, 500
        self.key_limit = MAX_ENTITY_KEY_LENGTH
        out_dir = out_dir.resolve()
        self.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{out_dir / 'mlflow.db'}"
        self.client = MlflowClient(tracking_uri=self.tracking_uri)
        project, run_name = _run_identity(out_dir, config)
        experiment = self.client.get_experiment_by_name(project)
        if experiment is None:
            local = not os.environ.get("MLFLOW_TRACKING_URI")  # a server picks its own artifact root
            try:
                experiment_id = self.client.create_experiment(
                    project, artifact_location=(out_dir / "mlartifacts").as_uri() if local else None)
            except MlflowException:  # created meanwhile by another run sharing the store
                experiment = self.client.get_experiment_by_name(project)
                if experiment is None:
                    raise
                experiment_id = experiment.experiment_id
        else:
            experiment_id = experiment.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        params = {}
        for key, value in _flatten(_config_dict(config) or {}).items():
            text = value if isinstance(value, str) else json.dumps(value)
            params[_mlflow_key(key, self.key_limit)] = text[:MAX_PARAM_VAL_LENGTH]
        items = [Param(k, v) for k, v in params.items()]
        try:
            for i in range(0, len(items), 100):  # mlflow's MAX_PARAMS_TAGS_PER_BATCH
                self.client.log_batch(self.run_id, params=items[i:i + 100])
        except BaseException:
            self.client.set_terminated(self.run_id, status="FAILED")
            raise

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        timestamp = int(time.time() * 1000)
        # keyed by the sanitised name: two keys that sanitise alike must not collide in one batch
        values = {_mlflow_key(k, self.key_limit): v for k, v in _scalars(metrics).items()}
        items = [Metric(key, value, timestamp, step) for key, value in values.items()]
        for i in range(0, len(items), 1000):  # mlflow's MAX_METRICS_PER_BATCH
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class MetricsLogger:
    """Sends each iteration's metrics to the chosen ``backends`` (see ``BACKENDS``); ``config`` (the
    run's ``Config``, may be None) names the wandb/mlflow project and run and is logged with them.

    It keeps no rows (a run of any length holds its memory flat; the rows are in the backends):
    ``mean(key)`` is the running mean of a numeric key over what was logged, and ``series[key]``
    every value of the keys named in ``series_keys``."""

    def __init__(self, out_dir: str | Path, backends=("console", "jsonl", "tensorboard"), echo=print,
                 config=None, series_keys: tuple[str, ...] = ("reward/mean",)) -> None:
        check_backends(backends)
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a") if "jsonl" in backends else None
        self._tb = None
        if "console" not in backends:
            echo = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        self._runs: list[_Wandb | _Mlflow] = []
        self.echo = echo
        self._sums: dict[str, list[float]] = {}  # key -> [sum, count]
        self.series: dict[str, list[float]] = {k: [] for k in series_keys}
        try:
            if "wandb" in backends:
                self._runs.append(_Wandb(self.out_dir, config))
            if "mlflow" in backends:
                self._runs.append(_Mlflow(self.out_dir, config))
        except BaseException:
            self.close()  # no wandb run left open behind a failed mlflow start
            raise

    def mean(self, key: str) -> float:
        """Mean of every numeric value logged under ``key``; NaN when there was none."""
        total, count = self._sums.get(key, (0.0, 0))
        return total / count if count else float("nan")

    def has(self, key: str) -> bool:
        return key in self._sums

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                acc = self._sums.setdefault(key, [0.0, 0])
                acc[0] += value
                acc[1] += 1
                if key in self.series:
                    self.series[key].append(float(value))
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=float) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        for run in self._runs:
            run.log(step, metrics)
        if echo and self.echo is not None:
            self.echo(console_line(step, metrics))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()
        runs, self._runs = self._runs, []
        for run in runs:
            run.close()

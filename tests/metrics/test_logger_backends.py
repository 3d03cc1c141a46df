"""The wandb and mlflow metric backends write under out_dir with no network, and read back.

wandb runs offline and its ``.wandb`` record file is decoded here; mlflow's sqlite store is
queried with ``MlflowClient``. Each test skips only when its extra (``streamrl[wandb]`` /
``streamrl[mlflow]``) is not installed; the missing-package checks need neither.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import subprocess
import sys
import time

import pytest

from streamrl.config import load_config
from streamrl.metrics.logger import MetricsLogger, check_backends

# mlflow 3's sqlalchemy store trips a sqlalchemy deprecation of its own; not ours to fix
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy:DeprecationWarning")


def _config(project="proj", run_name="myrun"):
    return load_config(None, [f"logging.project={project}", f"logging.run_name={run_name}"])


# ---------------------------------------------------------------------------------------- wandb


@pytest.fixture
def wandb_env(monkeypatch, tmp_path):
    """Offline, quiet, no git probing, and wandb's own settings/cache dirs inside tmp_path."""
    pytest.importorskip("wandb")
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_NAME", "WANDB_RUN_ID", "WANDB_RESUME", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DISABLE_GIT", "true")
    monkeypatch.setenv("WANDB_DISABLE_CODE", "true")
    for name, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / sub))


def _wandb_records(path):
    """Decode a ``.wandb`` file: a 7-byte header (``:W&B``, magic, version), then leveldb-log records
    (crc32 u32, length u16, type u8: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a wandb record file"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is zero padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pos += 7
        pending += data[pos:pos + length]
        pos += length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _wandb_run(out_dir, timeout=30.0):
    """(run record, history rows without wandb's own ``_`` keys) of the single offline run in out_dir.

    ``run.finish()`` can return before wandb-core's writer has flushed the ``.wandb`` file (its
    stream shuts down asynchronously), so wait for the run's ``exit`` record to land."""
    files = list(out_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, f"expected one offline run under {out_dir / 'wandb'}, found {files}"
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(files[0]))
        kinds = [record.WhichOneof("record_type") for record in records]
        if "exit" in kinds or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert "exit" in kinds, f"{files[0]} has no exit record after {timeout:.0f} s: {kinds}"
    run, rows = None, []
    for record, kind in zip(records, kinds):
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {(item.key or "/".join(item.nested_key)): json.loads(item.value_json) for item in record.history.item}
            rows.append({k: v for k, v in row.items() if not k.startswith("_")})
    assert run is not None, f"no run record in {files[0]}: {kinds}"
    return run, rows


def test_wandb_offline_run_keeps_every_row_including_late_steps(wandb_env, tmp_path):
    out = tmp_path / "out"
    logger = MetricsLogger(out, backends=["jsonl", "wandb"], echo=None, config=_config())
    logger.log(1, {"reward/mean": 0.5, "gen/tokens_per_s": 10, "note": "text", "bad": math.nan, "flag": True})
    logger.log(2, {"reward/mean": 0.7})
    logger.log(1, {"train/loss": 1.5}, echo=False)  # stream-async: iteration 0's training reports late
    logger.close()

    run, rows = _wandb_run(out)
    assert run.project == "proj" and run.display_name == "myrun"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["logging"]["project"] == "proj" and config["run"]["seed"] == 0
    # every row kept, in order, at its own iteration; only finite numbers go (no text, NaN, bool)
    assert rows == [
        {"iteration": 1, "reward/mean": 0.5, "gen/tokens_per_s": 10.0},
        {"iteration": 2, "reward/mean": 0.7},
        {"iteration": 1, "train/loss": 1.5},
    ]


def test_wandb_two_loggers_in_one_process_get_separate_runs(wandb_env, tmp_path):
    a = MetricsLogger(tmp_path / "a", backends=["wandb"], echo=None, config=None)
    b = MetricsLogger(tmp_path / "b", backends=["wandb"], echo=None, config=None)
    a.log(1, {"x": 1.0})
    b.log(1, {"y": 2.0})
    a.close()
    b.close()
    run_a, rows_a = _wandb_run(tmp_path / "a")
    run_b, rows_b = _wandb_run(tmp_path / "b")
    assert run_a.display_name == "a" and run_b.display_name == "b"  # config None: out_dir's name
    assert run_a.project == "streamrl"
    assert rows_a == [{"iteration": 1, "x": 1.0}] and rows_b == [{"iteration": 1, "y": 2.0}]


# --------------------------------------------------------------------------------------- mlflow


@pytest.fixture
def mlflow_env(monkeypatch):
    pytest.importorskip("mlflow")
    for name in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_EXPERIMENT_ID", "MLFLOW_RUN_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


def _history(client, run_id, key):
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_mlflow_local_store_under_out_dir(mlflow_env, tmp_path):
    from mlflow.tracking import MlflowClient

    out = tmp_path / "out"
    cfg = _config()
    logger = MetricsLogger(out, backends=["mlflow"], echo=None, config=cfg)
    logger.log(1, {"reward/mean": 0.5, "eval/acc@1": 0.25, "note": "text", "bad": math.inf})
    logger.log(2, {"reward/mean": 0.7})
    logger.log(1, {"train/loss": 1.5}, echo=False)  # late, below the last step: kept
    logger.close()

    assert (out / "mlflow.db").is_file()
    client = MlflowClient(tracking_uri=f"sqlite:///{out.resolve() / 'mlflow.db'}")
    experiment = client.get_experiment_by_name("proj")
    assert experiment is not None
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == "myrun" and run.info.status == "FINISHED"
    assert _history(client, run.info.run_id, "reward/mean") == [(1, 0.5), (2, 0.7)]
    assert _history(client, run.info.run_id, "train/loss") == [(1, 1.5)]
    assert _history(client, run.info.run_id, "eval/acc_1") == [(1, 0.25)]  # '@' is not allowed
    assert set(run.data.metrics) == {"reward/mean", "eval/acc_1", "train/loss"}
    params = run.data.params
    assert params["logging.project"] == "proj"
    assert float(params["trainer.lr"]) == cfg.trainer.lr
    assert json.loads(params["logging.backends"]) == cfg.logging.backends


def test_mlflow_honours_tracking_uri_and_keeps_two_loggers_apart(mlflow_env, monkeypatch, tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    a = MetricsLogger(tmp_path / "a", backends=["mlflow"], echo=None, config=None)
    b = MetricsLogger(tmp_path / "b", backends=["mlflow"], echo=None, config=None)
    a.log(3, {"x": 1.0})
    b.log(4, {"x": 2.0})
    a.close()
    b.close()

    assert not (tmp_path / "a" / "mlflow.db").exists() and not (tmp_path / "b" / "mlflow.db").exists()
    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("streamrl").experiment_id])
    by_name = {run.info.run_name: run.info.run_id for run in runs}
    assert sorted(by_name) == ["a", "b"]
    assert _history(client, by_name["a"], "x") == [(3, 1.0)]
    assert _history(client, by_name["b"], "x") == [(4, 2.0)]


# ---------------------------------------------------------------------- missing or unknown backend


@pytest.mark.parametrize("backend", ["wandb", "mlflow"])
def test_missing_package_is_one_line_naming_the_extra(backend, monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == backend else real(name, *a))
    with pytest.raises(ValueError) as info:
        check_backends(["console", backend])
    message = str(info.value)
    assert "\n" not in message and repr(backend) in message and f"pip install 'streamrl[{backend}]'" in message
    with pytest.raises(ValueError, match=rf"streamrl\[{backend}\]"):  # the logger checks first
        MetricsLogger(tmp_path / "out", backends=["jsonl", backend], echo=None)
    assert not (tmp_path / "out").exists()


def test_logger_keeps_running_means_and_the_reward_series_not_rows(tmp_path):
    logger = MetricsLogger(tmp_path, backends=("jsonl",))
    for step in range(1, 201):
        logger.log(step, {"reward/mean": step / 200, "time/gen_s": 2.0 if step % 2 else 4.0, "note": "x",
                          "flag": True}, echo=False)
    logger.log(201, {"eval/accuracy": 0.5}, echo=False)
    logger.close()
    assert not hasattr(logger, "history")  # rows live in the backends only
    assert logger.mean("time/gen_s") == pytest.approx(3.0) and logger.mean("eval/accuracy") == 0.5
    assert math.isnan(logger.mean("time/train_s")) and not logger.has("flag") and not logger.has("note")
    assert logger.series["reward/mean"] == [s / 200 for s in range(1, 201)]
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 201


def test_unknown_backend_is_named():
    with pytest.raises(ValueError, match="'nosuch'.*known: console"):
        check_backends(["console", "nosuch"])


def test_check_backends_imports_neither_package():
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    code = ("import sys; from streamrl.metrics.logger import check_backends; "
            "check_backends(['console', 'jsonl', 'tensorboard', 'wandb', 'mlflow']); "
            "print(sorted(m for m in ('wandb', 'mlflow', 'torch') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"

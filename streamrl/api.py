"""``streamrl.train``: one RL run from Python, with your reward and data handed over directly.

The same run as ``streamrl train``: the config decides everything; the arguments only fill in
what a script has in hand. ``reward_fn`` is one function or a list (the signature of
``tasks/user_reward.py``: ``fn(response, answer, prompt, metadata) -> float | dict``); they run in
the isolated reward workers (shipped there by cloudpickle, so a function defined in the calling
script works) beside any ``task.reward`` specs. ``dataset`` is a data file or ``datasets``
directory path, a list of row dicts, or a ``datasets.Dataset``; rows in memory are written to
``run.out_dir/dataset.jsonl`` first, so the run reads a real file and can be repeated from it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Iterable

from streamrl.config import Config, ConfigError, config_from_dict, load_config

Callback = Callable[[int, dict[str, float]], None]


def _dataset_path(dataset: Any, out_dir: Path) -> str:
    if isinstance(dataset, (str, Path)):
        return str(dataset)
    rows = dataset.to_list() if hasattr(dataset, "to_list") else list(dataset)
    if not rows or not all(isinstance(r, dict) for r in rows):
        raise ConfigError("train(dataset=...) must be a path, a non-empty list of row dicts or a datasets.Dataset")
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "dataset.jsonl"
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, default=str) + "\n")
    return str(path)


def train(cfg: Config | str | Path | None = None, *, reward_fn: Callable | list[Callable] | None = None,
          dataset: Any = None, callbacks: Iterable[Callback] = (), overrides: Iterable[str] = (),
          echo: Callable[[str], None] = print) -> dict[str, Any]:
    """Run RL post-training; returns the summary (held-out before/after, rewards, ``final_policy``).

    ``cfg`` is a ``Config``, a YAML path, or None (the built-in defaults); ``overrides`` are
    dotted ``key=value`` strings applied on top. ``callbacks`` are called as ``cb(iteration,
    metrics)`` after each iteration."""
    if not isinstance(cfg, Config):
        cfg = load_config(cfg, list(overrides))
    elif overrides:
        raise ConfigError("train(cfg=Config, overrides=...): apply overrides with load_config(path, overrides)")
    if dataset is not None:
        tree = cfg.model_dump()
        tree["task"]["train_path"] = _dataset_path(dataset, Path(cfg.run.out_dir))
        if tree["task"]["name"] in ("synthetic", "arithmetic"):
            tree["task"]["name"] = "file"
        cfg = config_from_dict(tree)
    from streamrl.controller.driver import train as run_training

    return run_training(cfg, echo=echo, reward_fn=reward_fn, callbacks=tuple(callbacks))

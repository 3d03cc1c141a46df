"""``logging``: where metrics and samples go (``streamrl.metrics.logger`` writes them).

Named ``logs`` so that no module here shadows the standard library's ``logging``.
"""

from __future__ import annotations

from typing import Literal

from streamrl.config.base import _Section


LOGGING_BACKENDS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")


class LoggingConfig(_Section):
    backends: list[Literal[LOGGING_BACKENDS]] = ["console", "jsonl", "tensorboard"]
    """where metrics go: console | jsonl (out_dir/metrics.jsonl) | tensorboard (out_dir/tensorboard) | wandb (offline
    unless WANDB_MODE says otherwise; pip install wandb) | mlflow (sqlite store out_dir/mlflow.db unless
    MLFLOW_TRACKING_URI; pip install mlflow)"""
    project: str = "streamrl"
    """wandb project / mlflow experiment name"""
    run_name: str | None = None
    """wandb / mlflow run name; None = out_dir's name"""
    samples: bool = False
    """write every trained sample (prompt, response, length, reward, versions) to run.out_dir/samples.jsonl: the
    rollout log, and `rank eval` records"""


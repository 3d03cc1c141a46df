"""One place where metrics leave the program: console line, JSONL file, tensorboard.

Components return metrics as flat dicts with namespaced keys (``gen/tokens_per_s``,
``train/step_s``, ``reward/mean``); the controller hands each iteration's dict to ``log``.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

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


def console_line(step: int, metrics: dict[str, Any]) -> str:
    parts = [f"iter {step:4d}"]
    for key, label, fmt in CONSOLE_KEYS:
        if key in metrics and metrics[key] is not None:
            parts.append(f"{label} {fmt.format(metrics[key])}")
    return " | ".join(parts)


class MetricsLogger:
    def __init__(self, out_dir: str | Path, backends=("console", "jsonl", "tensorboard"), echo=print,
                 config=None) -> None:
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.out_dir / "metrics.jsonl", "a") if "jsonl" in backends else None
        self._tb = None
        if "console" not in backends:
            echo = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.out_dir / "tensorboard"))
        self.echo = echo
        self.history: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any], echo: bool = True) -> None:
        record = {"step": step, "time": time.time(), **metrics}
        self.history.append(record)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, default=float) + "\n")
            self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                    self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if echo and self.echo is not None:
            self.echo(console_line(step, metrics))

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tb is not None:
            self._tb.close()

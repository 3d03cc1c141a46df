"""The task interface: where prompts come from and how a response is scored.

A ``Task`` hands the controller two fixed prompt lists (train, held-out eval) and a verifiable
``reward(prompt, response) -> float`` (1.0 correct, 0.0 otherwise). The reward worker never calls
``reward`` directly: it goes through ``streamrl.tasks.rewards.RewardRunner``, which adds the
timeout and error accounting. A task whose reward is a cheap, trusted pure function (no parsing
of hostile input that could hang) sets ``reward_is_fast = True`` so the runner calls it in-process.

Loaders that read files fill a ``LoadReport``: every row read, every row skipped and why (file,
line, what was wrong), logged through ``logging`` as it happens — rows are never dropped silently.
"""

from __future__ import annotations

import logging
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path

from streamrl.types import Prompt

log = logging.getLogger(__name__)


def default_data_dir() -> Path:
    """``$STREAMRL_DATA_DIR`` if set, else ``<repo root>/../shared/data`` (never copied into the repo)."""
    env = os.environ.get("STREAMRL_DATA_DIR")
    if env:
        return Path(env)
    repo_root = Path(__file__).resolve().parents[2]
    return repo_root.parent / "shared" / "data"


@dataclass(frozen=True)
class SkippedRow:
    """One row a loader refused: where it was and what was wrong with it."""

    source: str
    """File the row came from."""
    line: int
    """1-based line number (jsonl) or row index + 1 (parquet)."""
    reason: str
    """What was wrong, naming the field and the offending value where there is one."""


@dataclass
class LoadReport:
    """Counts from loading one source: rows read, rows kept, rows skipped (with reasons)."""

    source: str
    rows_read: int = 0
    rows_kept: int = 0
    skipped: list[SkippedRow] = field(default_factory=list)

    def skip(self, line: int, reason: str) -> None:
        """Record (and log) one skipped row."""
        row = SkippedRow(self.source, line, reason)
        self.skipped.append(row)
        log.warning("skipping row: %s line %d: %s", row.source, row.line, row.reason)

    @property
    def rows_skipped(self) -> int:
        return len(self.skipped)

    def metrics(self) -> dict[str, float]:
        return {
            "task/rows_read": float(self.rows_read),
            "task/rows_kept": float(self.rows_kept),
            "task/rows_skipped": float(self.rows_skipped),
        }

    def summary(self) -> str:
        text = f"{self.source}: read {self.rows_read} rows, kept {self.rows_kept}, skipped {self.rows_skipped}"
        if self.skipped:
            shown = "; ".join(f"line {s.line}: {s.reason}" for s in self.skipped[:5])
            more = f" (+{self.rows_skipped - 5} more)" if self.rows_skipped > 5 else ""
            text += f" [{shown}{more}]"
        return text


class Task(ABC):
    """A prompt source with a verifiable reward."""

    name: str = "task"
    reward_is_fast: bool = False
    """True if ``reward`` is a cheap, trusted pure function: the runner skips the process hop
    (exceptions are still caught and counted, but there is no timeout)."""

    @abstractmethod
    def train_prompts(self) -> list[Prompt]:
        """Training prompts, in a deterministic order."""

    @abstractmethod
    def eval_prompts(self) -> list[Prompt]:
        """Held-out evaluation prompts, disjoint from the training prompts."""

    @abstractmethod
    def reward(self, prompt: Prompt, response: str) -> float:
        """1.0 if ``response`` answers ``prompt`` correctly, else 0.0."""

    def load_report(self) -> LoadReport | None:
        """What loading the task's data read and skipped; None for generated tasks."""
        return None

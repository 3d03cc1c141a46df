"""One run per run directory (``run.out_dir``).

- A lock (``.lock``, ``fcntl.flock``, held for the whole run) keeps a second concurrent run out.
- A fresh run into a directory that holds a run's files refuses (``run.overwrite=true`` removes
  those files first; nothing else in the directory is touched).
- A resume needs a checkpoint; on resume the logs are cut back to it: ``metrics.jsonl`` keeps the
  rows up to the checkpoint's step (the rollout log is cut by ``SampleLog`` likewise), so a killed
  run's later rows do not sit beside the resumed run's.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

from streamrl.errors import UserError

RUN_FILES = ("metrics.jsonl", "summary.json", "timeline.json", "timeline.jsonl", "gantt.png", "samples.jsonl", "config.yaml", "mlflow.db",
             "lineage.json", "faults.jsonl")
RUN_DIRS = ("checkpoint", "checkpoints", "policy", "policy.tmp", "policy-merged", "policy-merged.tmp", "tensorboard", "wandb")
LOCK = ".lock"


class RunDirError(UserError):
    """``run.out_dir`` cannot take this run as configured."""


class RunDir:
    """The locked run directory; ``close()`` (or the end of the process) releases the lock."""

    def __init__(self, out: str | Path, resume: bool, overwrite: bool) -> None:
        self.path = Path(out)
        self.path.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._fd)
            raise RunDirError(f"run.out_dir={self.path} is in use by another run (pid {holder}); "
                              "wait for it or choose another run.out_dir") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
        try:
            self._check(resume, overwrite)
        except BaseException:
            self.close()
            raise

    def _check(self, resume: bool, overwrite: bool) -> None:
        used = [n for n in RUN_FILES + RUN_DIRS if (self.path / n).exists()]
        if resume:
            if not self.has_checkpoint():
                raise RunDirError(f"run.resume=true, but {self.path / 'checkpoint'} holds no checkpoint "
                                  "(trainer.pt): nothing to resume; drop run.resume to start a new run")
            return
        if not used:
            return
        if not overwrite:
            raise RunDirError(f"run.out_dir={self.path} already holds a run ({', '.join(used[:4])}"
                              f"{', ...' if len(used) > 4 else ''}): continue it with run.resume=true, replace "
                              "it with run.overwrite=true, or choose another run.out_dir")
        for name in used:
            p = self.path / name
            shutil.rmtree(p) if p.is_dir() else p.unlink()

    def has_checkpoint(self) -> bool:
        return (self.path / "checkpoint" / "trainer.pt").is_file()

    def cut_metrics(self, last_step: int) -> int:
        """Keep the ``metrics.jsonl`` rows with ``step <= last_step``; returns how many were dropped."""
        path = self.path / "metrics.jsonl"
        if not path.is_file():
            return 0
        kept, dropped = [], 0
        for line in path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:  # a line cut short by the kill
                dropped += 1
                continue
            if isinstance(row, dict) and int(row.get("step", 0)) <= last_step:
                kept.append(line + "\n")
            else:
                dropped += 1
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept))
        tmp.replace(path)
        return dropped

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor releases the flock
            self._fd = None

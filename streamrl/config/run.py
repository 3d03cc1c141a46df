"""``run``: how long a run goes, where it writes, and when it evaluates and checkpoints."""

from __future__ import annotations

from pydantic import Field

from streamrl.config.base import _Section


class RunConfig(_Section):
    seed: int = 0
    """seed of data order, sampling and initialisation"""
    iterations: int = Field(30, ge=1)
    """RL iterations (one optimizer round each)"""
    out_dir: str = "runs/latest"
    """metrics.jsonl, tensorboard, timeline, ckpts"""
    trainer_timeout_s: float | None = Field(3600.0, gt=0)
    """a call to the trainer (an iteration's training included) that takes longer stops the run: a hung trainer is an
    error, not a wait (its start gets at least 600 s); None waits forever"""
    eval_every: int = Field(0, ge=0)
    """evaluate on the held-out set every k iterations; 0 = only before/after"""
    checkpoint_every: int = Field(0, ge=0)
    """save a checkpoint every k iterations; 0 = only at the end"""
    keep_checkpoints: bool = False
    """also keep each periodic checkpoint's policy as out_dir/checkpoints/iter-<k> (the latest is always
    out_dir/checkpoint)"""
    resume: bool = False
    """resume from the latest checkpoint in out_dir (refuses if there is none)"""
    overwrite: bool = False
    """a fresh run into an out_dir that holds a run removes that run's files first; without it such a run refuses"""
    eval_samples: int = Field(2, ge=1)
    """samples per held-out prompt (temperature as in training)"""


"""The learning-rate schedule: linear warmup, then constant or cosine decay (``trainer.lr_*``).

A pure function of the optimizer step count, which checkpoints already hold (``Trainer.steps``),
so a resumed run continues the schedule where it stopped without a scheduler state of its own.
"""

from __future__ import annotations

import math


def lr_at(tcfg, step: int, default_decay_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based) under ``tcfg`` (a ``TrainerConfig``):
    ``lr * (step + 1) / lr_warmup_steps`` during warmup; then ``lr``, or a cosine from ``lr`` at the
    end of warmup to ``lr * lr_min_ratio`` at ``lr_decay_steps`` (``default_decay_steps`` when 0)
    and flat after it."""
    warm = tcfg.lr_warmup_steps
    if warm and step < warm:
        return tcfg.lr * (step + 1) / warm
    if tcfg.lr_schedule == "constant":
        return tcfg.lr
    end = tcfg.lr_decay_steps or default_decay_steps
    span = max(end - warm, 1)
    progress = min(max(step - warm, 0) / span, 1.0)
    low = tcfg.lr * tcfg.lr_min_ratio
    return low + (tcfg.lr - low) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_for_step(cfg, step: int) -> float:
    """``lr_at`` for a run's config: the cosine's default end is one step per iteration and epoch."""
    return lr_at(cfg.trainer, step, cfg.run.iterations * cfg.trainer.epochs)


def set_lr(optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr

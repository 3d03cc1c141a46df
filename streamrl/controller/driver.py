"""`streamrl train`: check what can be checked before any work (logging backends, the placement
plan, the user's reward), lock ``run.out_dir``, then hand over to ``Run`` (``run.py``)."""

from __future__ import annotations

from typing import Any

from streamrl.config import Config
from streamrl.controller.run import run_training
from streamrl.controller.setup import user_reward
from streamrl.placement import plan_placement


def train(cfg: Config, echo=print, reward_fn=None, callbacks=()) -> dict[str, Any]:
    """One RL run as configured; ``reward_fn`` (a callable or a list, see ``tasks/user_reward.py``)
    adds to or replaces the task's verifier; each callback is called as ``cb(iteration, metrics)``
    after every iteration. Returns the summary (also written to ``run.out_dir/summary.json``).
    ``run.out_dir`` is locked for the run (``rundir.py``); Ctrl-C stops it after a checkpoint
    where one is exact (``RunInterrupted`` says which)."""
    from streamrl.config import ConfigError
    from streamrl.metrics.logger import check_backends

    try:
        check_backends(cfg.logging.backends)  # a backend whose package is missing fails before any work
    except ValueError as exc:
        raise ConfigError(f"logging.backends: {exc}") from None
    from streamrl.controller.rundir import RunDir

    plan = plan_placement(cfg)  # once, before any work: an impossible plan fails here, naming the keys
    reward = user_reward(cfg, reward_fn)
    if cfg.task.multi_turn:  # the env and tools import, with schemas, before any work
        from streamrl.controller.setup import agent_schemas

        agent_schemas(cfg)
    rundir = RunDir(cfg.run.out_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite)  # locked for the run
    try:
        return run_training(cfg, echo, reward, callbacks, plan, rundir)
    finally:
        rundir.close()

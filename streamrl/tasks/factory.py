"""The configured task (prompt source + verifiable reward), by ``task.name``."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from streamrl.config import Config


def make_task(cfg: "Config"):
    """The configured task (prompt source + verifiable reward)."""
    t = cfg.task
    if t.name == "synthetic":
        from streamrl.tasks.synthetic import SyntheticTask

        return SyntheticTask(num_train=t.num_train, num_eval=t.num_eval, seed=cfg.run.seed,
                             partial_credit=t.partial_credit, length_ramp=t.length_ramp)
    if t.name == "arithmetic":
        from streamrl.tasks.arithmetic import ArithmeticTask

        return ArithmeticTask(num_train=t.num_train, num_eval=t.num_eval, seed=cfg.run.seed,
                              max_operand=t.max_operand, max_terms=t.max_terms)
    from streamrl.tasks.math import MathTask

    return MathTask.from_config(t, seed=cfg.run.seed)

"""Elastic generation scaling (PAPER.md §3.4).

Watch ``delta = T_gen - T_train`` each iteration. Let ``delta_prime`` be the generation time one
more SGS data-parallel unit (one instance) would save, ``T_gen(k) - T_gen(k + 1)``. When
``delta >= delta_prime``, add one instance: the gap is at least what the new instance closes, so
adding it cannot make generation the faster side by more than it was the slower one. Instances
are independent, so the trainer keeps running. Like the paper, we only scale up. We add one
guard the paper leaves implicit: an instance that is predicted to save nothing (``delta_prime <= 0``,
e.g. a tail-bound generation stage) is never added.

``ElasticRule.decide`` takes plain numbers; the caller (simulator or live controller) supplies
``t_gen_plus_one`` from its estimator ``P_gen``. ``smoothing`` (0 = off) applies an exponential
moving average to ``delta`` so one slow iteration does not trigger a scale-up on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def should_add_instance(t_gen: float, t_train: float, t_gen_plus_one: float) -> bool:
    """The paper's rule: ``T_gen - T_train >= T_gen - T_gen(+1 instance)``."""
    delta = t_gen - t_train
    delta_prime = t_gen - t_gen_plus_one
    return delta > 0 and 0 < delta_prime <= delta


@dataclass
class ElasticRule:
    """Stateful wrapper: caps the instance count and optionally smooths ``delta``."""

    max_instances: int
    smoothing: float = 0.0
    _delta_ema: float | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.smoothing < 1.0:
            raise ValueError(f"smoothing={self.smoothing} must be in [0, 1)")

    def decide(self, instances: int, t_gen: float, t_train: float, t_gen_plus_one: float) -> int:
        """How many instances to add now: 0 or 1."""
        delta = t_gen - t_train
        if self.smoothing and self._delta_ema is not None:
            delta = self.smoothing * self._delta_ema + (1 - self.smoothing) * delta
        self._delta_ema = delta
        if instances >= self.max_instances:
            return 0
        return int(delta > 0 and 0 < t_gen - t_gen_plus_one <= delta)

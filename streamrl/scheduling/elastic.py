"""Elastic generation scaling (PAPER.md §3.4).

Watch ``delta = T_gen - T_train`` each iteration. Let ``delta_prime`` be the generation time one
more SGS data-parallel unit (one instance) would save, ``T_gen(k) - T_gen(k + 1)``. When
``delta >= delta_prime``, add one instance: the gap is at least what the new instance closes, so
adding it cannot make generation the faster side by more than it was the slower one. Instances
are independent, so the trainer keeps running. The paper only scales up; ``ElasticScaler`` also
scales down (beyond the paper).

Pure functions and small state machines: the caller (simulator or live controller) supplies the
measured times and ``t_gen_plus_one`` from its estimator ``P_gen``.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def should_add_instance(t_gen: float, t_train: float, t_gen_plus_one: float) -> bool:
    """The paper's rule: ``T_gen - T_train >= T_gen - T_gen(+1 instance)``.

    One guard the paper leaves implicit: an instance that is predicted to save nothing
    (``delta_prime <= 0``, e.g. a tail-bound generation stage) is never added."""
    delta = t_gen - t_train
    delta_prime = t_gen - t_gen_plus_one
    return delta > 0 and 0 < delta_prime <= delta


@dataclass
class ElasticRule:
    """Stateful wrapper: caps the instance count and optionally smooths ``delta``.

    ``smoothing`` (0 = off) applies an exponential moving average to ``delta`` so one slow
    iteration does not trigger a scale-up on its own."""

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


def predict_gen_time(t_gen: float, instances: int, new_instances: int, t_tail: float) -> float:
    """``P_gen`` from a measured iteration: a throughput-bound stage scales with the instance
    count, but never below its longest single request (``t_tail``), which one instance must run
    alone whatever the count (the long tail)."""
    if instances < 1 or new_instances < 1:
        raise ValueError(f"instance counts must be >= 1, got {instances} -> {new_instances}")
    return max(t_gen * instances / new_instances, min(t_tail, t_gen))


@dataclass
class ElasticScaler:
    """The live controller's decision per iteration: +1, -1 or 0 instances.

    Up: the paper's rule (``ElasticRule``) with ``P_gen(k + 1)`` from ``predict_gen_time``, and
    only if that instance is predicted to save at least ``min_gain`` of the generation time (a
    measured iteration is noisy, and a tail-bound stage gains almost nothing from one more).
    Down (beyond the paper): when generation with one instance fewer is still predicted at most
    ``(1 - margin) x T_train`` for ``patience`` iterations in a row, and no change happened in
    the last ``patience`` iterations. The margin keeps a removal from being undone by the up rule
    at once (with ``k - 1`` instances generation stays faster than training), the patience keeps
    one fast iteration from removing anything: together they stop flapping."""

    min_instances: int
    max_instances: int
    patience: int = 3
    margin: float = 0.25
    min_gain: float = 0.1
    smoothing: float = 0.0
    _low: int = field(default=0, init=False, repr=False)
    _since_change: int = field(default=10**9, init=False, repr=False)

    def __post_init__(self) -> None:
        if not 1 <= self.min_instances <= self.max_instances:
            raise ValueError(f"need 1 <= min_instances ({self.min_instances}) <= max_instances ({self.max_instances})")
        self.rule = ElasticRule(self.max_instances, self.smoothing)

    def decide(self, instances: int, t_gen: float, t_train: float, t_tail: float) -> int:
        self._since_change += 1
        plus_one = predict_gen_time(t_gen, instances, instances + 1, t_tail)
        if self.rule.decide(instances, t_gen, t_train, plus_one) and t_gen - plus_one >= self.min_gain * t_gen:
            self._low, self._since_change = 0, 0
            return 1
        if instances > self.min_instances and predict_gen_time(t_gen, instances, instances - 1, t_tail) <= (
                1 - self.margin) * t_train:
            self._low += 1
        else:
            self._low = 0
        if self._low >= self.patience and self._since_change >= self.patience:
            self._low, self._since_change = 0, 0
            return -1
        return 0

"""Dispatch policies: which generation instance gets each request (PAPER.md §3.7, Algorithm 2).

Interface: ``policy.assign(predicted_lengths, num_instances) -> list[int]``, for each request
(in the given order) the index of its instance; ``observe`` feeds finished lengths to policies
that read the recent length distribution. Predicted lengths come from the output-length ranker.

Invariants: policies are pure (the same inputs and seed give the same assignment) and nothing
here imports Ray, torch or an engine. ``random``, ``round-robin``, ``least-loaded``,
``skewness-aware`` (Algorithm 2) and ``skewness-search`` (ours) are in ``DISPATCH_POLICIES``;
each class says what it does. docs/design.md, "The Stream Generation Service", says why.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Sequence

from streamrl.scheduling.latency import H800_QWEN7B_VLLM, LatencyModel


class DispatchPolicy:
    """One-method interface: ``assign``; ``observe`` (finished lengths, for policies that learn the
    length distribution, e.g. Algorithm 2's P50/P90) is a no-op unless a policy needs it."""

    name: str

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        """Instance index for each request, in request order."""
        raise NotImplementedError

    def observe(self, output_lengths: Sequence[float]) -> None:
        """The actual output lengths of a finished batch."""


def _check(num_instances: int) -> None:
    if num_instances < 1:
        raise ValueError(f"num_instances={num_instances}: need at least one generation instance")


class RandomDispatch(DispatchPolicy):
    """A uniform random instance per request (seeded)."""

    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self.rng = random.Random(seed)

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        _check(num_instances)
        return [self.rng.randrange(num_instances) for _ in predicted_lengths]


class RoundRobinDispatch(DispatchPolicy):
    """Request ``i`` to instance ``i mod N``."""

    name = "round-robin"

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        _check(num_instances)
        return [i % num_instances for i in range(len(predicted_lengths))]


def _greedy_least_loaded(lengths: Sequence[float], order: Sequence[int], instances: Sequence[int], out: list[int]) -> None:
    """Put each request of ``order`` on the instance of ``instances`` with least predicted load."""
    load = {inst: 0.0 for inst in instances}
    count = {inst: 0 for inst in instances}
    for i in order:
        inst = min(instances, key=lambda k: (load[k], count[k], k))
        out[i] = inst
        load[inst] += max(float(lengths[i]), 0.0)
        count[inst] += 1


class LeastLoadedDispatch(DispatchPolicy):
    """In arrival order, each request to the instance with the smallest predicted token load so
    far (ties to the lowest index); equal predictions reduce it to request counts. Unlike the
    skewness policies it uses the predictions' magnitudes, not only their order."""

    name = "least-loaded"

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        _check(num_instances)
        out = [0] * len(predicted_lengths)
        _greedy_least_loaded(predicted_lengths, range(len(predicted_lengths)), range(num_instances), out)
        return out


def _quantile(values: Sequence[float], q: float) -> float:
    xs = sorted(values)
    if not xs:
        raise ValueError("quantile of an empty length history")
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


class _RecentLengths(DispatchPolicy):
    """Dispatch that reads the recent output-length distribution (``history``); the SGS calls
    ``observe`` with each finished batch's lengths."""

    history: list[float] | None = None

    def observe(self, output_lengths: Sequence[float]) -> None:
        """Replace the recent output-length distribution (call once per iteration)."""
        self.history = list(output_lengths)


@dataclass(frozen=True)
class SkewSplit:
    """The split Algorithm 2 chose, and the latencies it predicted."""

    long_instances: int
    long_requests: int
    long_latency_s: float
    regular_latency_s: float
    cost_s: float


def skewness_split(
    num_requests: int,
    num_instances: int,
    long_len: float,
    regular_len: float,
    latency: LatencyModel,
    alpha: float = 0.2,
    max_batch_size: int | None = None,
    combine: str = "max",
) -> SkewSplit:
    """Algorithm 2's search: the number of long-tail instances minimising the predicted latency.

    **Sum or max of the two pools' latencies.** The paper prints the *sum*; ``combine="max"``
    (the default) minimises the *max*. The two pools run at the same time on disjoint instances,
    so the generation stage ends when the slower pool ends: its makespan is the max. Minimising
    the sum can pick a split whose slower pool is slower than necessary just to shorten the
    faster pool, whose instances then sit idle anyway (``tests/scheduling/test_scheduling.py`` has a
    hand-worked case where the two criteria disagree). ``combine="sum"`` reproduces the paper's
    formula."""
    _check(num_instances)
    if combine not in ("max", "sum"):
        raise ValueError(f"combine={combine!r}: use 'max' (makespan) or 'sum' (paper's formula)")
    n_long = min(num_requests, max(1, round(alpha * num_requests))) if num_requests >= 2 else 0
    n_reg = num_requests - n_long
    if num_instances == 1 or n_long == 0 or n_reg == 0:
        lat = latency.pool_latency_s(math.ceil(num_requests / num_instances), max(long_len, regular_len), max_batch_size)
        return SkewSplit(0, 0, 0.0, lat, lat)
    best: SkewSplit | None = None
    for k in range(1, num_instances):
        t_long = latency.pool_latency_s(math.ceil(n_long / k), long_len, max_batch_size)
        t_reg = latency.pool_latency_s(math.ceil(n_reg / (num_instances - k)), regular_len, max_batch_size)
        cost = max(t_long, t_reg) if combine == "max" else t_long + t_reg
        if best is None or cost < best.cost_s - 1e-12:
            best = SkewSplit(k, n_long, t_long, t_reg, cost)
    assert best is not None
    return best


class SkewnessAwareDispatch(_RecentLengths):
    """Algorithm 2. Sort requests by predicted length (only their order matters); the top
    ``alpha`` are long-tail, the rest regular. A long-tail sample's length is estimated by the
    P90 and a regular one's by the P50 of the recent output-length distribution (``history``;
    the predictions themselves when none is given). For every split ``N_long + N_regular = N``
    each pool's latency is predicted as ``PTL(BS) * L * ceil(M_pool_per_instance / BS)`` and the
    best split is kept (``skewness_split``); inside a pool, requests go longest-first to the
    instance with the least predicted load. ``last_split`` holds the latest decision."""

    name = "skewness-aware"

    def __init__(
        self,
        latency: LatencyModel = H800_QWEN7B_VLLM,
        alpha: float = 0.2,
        max_batch_size: int | None = None,
        history: Sequence[float] | None = None,
        combine: str = "max",
        long_quantile: float = 0.9,
        regular_quantile: float = 0.5,
    ) -> None:
        if not 0 < alpha < 1:
            raise ValueError(f"alpha={alpha}: the long-tail fraction must be in (0, 1)")
        self.latency = latency
        self.alpha = alpha
        self.max_batch_size = max_batch_size
        self.history = list(history) if history is not None else None
        self.combine = combine
        self.long_quantile = long_quantile
        self.regular_quantile = regular_quantile
        self.last_split: SkewSplit | None = None

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        _check(num_instances)
        n = len(predicted_lengths)
        out = [0] * n
        if n == 0:
            return out
        hist = self.history if self.history else list(predicted_lengths)
        split = skewness_split(
            n, num_instances, _quantile(hist, self.long_quantile), _quantile(hist, self.regular_quantile),
            self.latency, self.alpha, self.max_batch_size, self.combine,
        )
        self.last_split = split
        order = sorted(range(n), key=lambda i: -predicted_lengths[i])
        k = split.long_instances
        if k == 0:
            _greedy_least_loaded(predicted_lengths, order, range(num_instances), out)
            return out
        _greedy_least_loaded(predicted_lengths, order[: split.long_requests], range(k), out)
        _greedy_least_loaded(predicted_lengths, order[split.long_requests:], range(k, num_instances), out)
        return out


def instance_makespan_s(lengths: Sequence[float], latency: LatencyModel, max_batch_size: int,
                        prompt_len: float = 0.0) -> float:
    """Decode time of one instance under the latency model: requests admitted longest-first
    (LPT), at most ``max_batch_size`` running, every running request gains one token per step,
    and a step with ``b`` running requests holding ``C`` context tokens (``prompt_len`` each plus
    what they generated) costs ``PTL(b) + kv_ms_per_token x C``. Event-driven (one event per
    finish; the context sum grows linearly in between), so O(M log M)."""
    import heapq

    kv_s = latency.kv_ms_per_token / 1000.0
    queue = sorted((max(float(x), 0.0) for x in lengths), reverse=True)
    running: list[tuple[float, float]] = []  # (finish step, admission step) of each running request
    admitted_sum = 0.0  # sum of the running requests' admission steps
    step = elapsed = 0.0
    nxt = 0
    while nxt < len(queue) or running:
        while nxt < len(queue) and len(running) < max_batch_size:
            heapq.heappush(running, (step + queue[nxt], step))
            admitted_sum += step
            nxt += 1
        b = len(running)
        finish, admitted = running[0]
        span = finish - step
        context = b * (prompt_len + step) - admitted_sum  # tokens held at the first step of the span
        elapsed += latency.seconds_per_token(b) * span + kv_s * (context * span + b * span * (span - 1) / 2)
        heapq.heappop(running)
        admitted_sum -= admitted
        step = finish
    return elapsed


@dataclass(frozen=True)
class SearchedSplit:
    """The (alpha, long-tail instances) that ``SkewSearchDispatch`` chose, and its prediction."""

    alpha: float
    long_instances: int
    long_requests: int
    predicted_s: float


class SkewSearchDispatch(_RecentLengths):
    """Algorithm 2 with the long-tail fraction searched and each candidate simulated.

    The paper fixes ``alpha`` (20 %) and predicts a pool by ``PTL(BS) * L * ceil(M/BS)`` with
    L = P90 (long) or P50 (regular). On an instance that admits all its requests at once the
    longest request sets the end and the batch shrinks as the short ones finish, which that
    formula does not see; and the best long-tail fraction depends on the PTL curve and the
    batch. So here, for every ``alpha`` in ``alphas`` (0 = no long-tail pool) and every split
    ``k`` long-tail instances out of N:

    1. requests sorted by predicted length; the r-th longest of n gets the recent distribution's
       (``history``) quantile ``1 - r/(n-1)``: the longest its max, the shortest its min (only the
       ranking's order is used);
    2. the top ``alpha`` go longest-first to the least-loaded of the ``k`` long-tail instances,
       the rest the same way over the other ``N - k`` (``k = 0``: everything over all N);
    3. each instance's decode time is simulated (``instance_makespan_s``: LPT admission, batch
       limit, PTL of the running count plus the profile's per-context-token cost, with
       ``prompt_len`` tokens of prompt per request), and the candidate's cost is the slowest
       instance.

    The cheapest candidate wins (ties to the smaller alpha, then fewer long-tail instances).
    ``last_split`` records it."""

    name = "skewness-search"

    def __init__(self, latency: LatencyModel = H800_QWEN7B_VLLM, max_batch_size: int | None = None,
                 history: Sequence[float] | None = None, alphas: Sequence[float] = (0.0, 0.025, 0.05, 0.1, 0.2, 0.3),
                 prompt_len: float = 0.0) -> None:
        bad = [a for a in alphas if not 0 <= a < 1]
        if bad or not alphas:
            raise ValueError(f"alphas={list(alphas)}: need a non-empty list of long-tail fractions in [0, 1)")
        self.latency = latency
        self.max_batch_size = max_batch_size or latency.max_batch_size
        self.history = list(history) if history is not None else None
        self.alphas = sorted(set(float(a) for a in alphas))
        self.prompt_len = prompt_len
        self.last_split: SearchedSplit | None = None

    def assign(self, predicted_lengths: Sequence[float], num_instances: int) -> list[int]:
        _check(num_instances)
        n = len(predicted_lengths)
        if n == 0:
            return []
        order = sorted(range(n), key=lambda i: -predicted_lengths[i])
        hist = self.history if self.history else list(predicted_lengths)
        est = [0.0] * n  # the r-th longest request's length: the history quantile at rank r
        for r, i in enumerate(order):  # the longest gets the history's max, the shortest its min
            est[i] = _quantile(hist, 1.0 - r / (n - 1) if n > 1 else 0.5)
        best: tuple[float, float, int, list[int], int] | None = None
        for alpha in self.alphas:
            n_long = round(alpha * n)
            splits = [0] if n_long == 0 or n_long == n else range(1, num_instances)
            for k in splits:
                out = [0] * n
                if k == 0:
                    _greedy_least_loaded(est, order, range(num_instances), out)
                else:
                    _greedy_least_loaded(est, order[:n_long], range(k), out)
                    _greedy_least_loaded(est, order[n_long:], range(k, num_instances), out)
                per_inst: dict[int, list[float]] = {}
                for i, inst in enumerate(out):
                    per_inst.setdefault(inst, []).append(est[i])
                cost = max(instance_makespan_s(v, self.latency, self.max_batch_size, self.prompt_len)
                           for v in per_inst.values())
                if best is None or cost < best[0] - 1e-12:
                    best = (cost, alpha, k, out, n_long if k else 0)
        assert best is not None
        cost, alpha, k, out, n_long = best
        self.last_split = SearchedSplit(alpha, k, n_long, cost)
        return out


DISPATCH_POLICIES: dict[str, type] = {
    "random": RandomDispatch,
    "round-robin": RoundRobinDispatch,
    "least-loaded": LeastLoadedDispatch,
    "skewness-aware": SkewnessAwareDispatch,
    "skewness-search": SkewSearchDispatch,
}


def make_dispatch_policy(name: str, **kwargs) -> DispatchPolicy:
    """The dispatch policy called ``name`` built with ``kwargs`` (e.g. ``seed``, ``latency``).

    Unknown names raise ``ValueError`` listing the known ones; keyword arguments a policy does not
    take raise ``TypeError`` from its constructor.
    """
    try:
        cls = DISPATCH_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown dispatch policy {name!r}; known: {sorted(DISPATCH_POLICIES)}") from None
    return cls(**kwargs)

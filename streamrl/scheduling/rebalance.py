"""Runtime rebalancing (beyond the paper: PAPER.md §5, after Seer's critique of atomic dispatch).

StreamRL dispatches each request once; a wrong length estimate can then leave one instance with
far more work than the others while they idle. Rebalancing re-plans unfinished requests while
generation runs: queued ones (moving one costs nothing) and, where the engine can preempt,
running ones (resumed elsewhere with the prefix they generated: ``StreamGenerationService``).

One check, ``plan_round``, is shared by the SGS and the simulator (``sim/engine.py``); it calls
``plan_moves``, which moves requests from the most to the least loaded instance while that
lowers the predicted makespan (``remaining_time_s``). Pure functions: no Ray, no engine; the
caller applies the moves returned. docs/design.md, "The Stream Generation Service", says why.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Collection, Mapping, Sequence

from streamrl.scheduling.latency import LatencyModel


MIN_MOVE_TOKENS = 8  # a running request predicted to finish within this many tokens is not moved


@dataclass(frozen=True)
class Unfinished:
    """One unfinished request as a rebalancing check sees it."""

    request_id: str
    predicted: float
    """Predicted total output length (the ranker's, or the oracle's)."""
    generated: int
    """Tokens generated so far (a resumed request's prefix included); 0 if it has not started."""
    budget: int
    """Its whole token budget: ``max_new_tokens`` of the request as first submitted."""
    started: bool
    """Running (True), or not started: held or queued (False)."""
    may_move: bool
    """Where it is, it could be taken away: not started and movable there, or running on an engine
    that preempts (and, by the caller's rule, not moved before)."""


@dataclass(frozen=True)
class Move:
    """Move ``request_id`` from instance ``src`` to instance ``dst`` (names as given)."""

    request_id: str
    src: str
    dst: str
    predicted_len: float


def remaining_estimate(predicted: float, generated: int, max_new_tokens: int, recent: Sequence[float]) -> float:
    """Tokens a request still has to generate, from its predicted length and its progress.

    Below its prediction: the difference. At or past it the prediction was too short; then the
    median overshoot of the recent lengths (``recent``, sorted) that got this far (``L - g``
    over ``L > g``), or, when none did, as many tokens again as it has (doubling). Never more
    than ``max_new_tokens - generated``, never less than 1."""
    left = max(1.0, float(max_new_tokens - generated))
    if generated < predicted:
        return min(left, max(1.0, predicted - generated))
    i = bisect.bisect_right(recent, generated)
    if i < len(recent):
        over = recent[i:]
        return min(left, max(1.0, float(over[len(over) // 2]) - generated))
    return min(left, max(1.0, float(generated)))


def remaining_time_s(lengths: Sequence[float], latency: LatencyModel, max_batch_size: int | None = None) -> float:
    """Predicted time for one instance to finish requests of these predicted lengths: the §3.7
    latency model applied to what is left::

        T(L) = PTL(BS) * max(sum(L) / BS, max(L)),   BS = min(len(L), max_batch_size)

    (``sum(L) / BS`` decode steps of a full batch, and never less than its longest request alone)."""
    n = len(lengths)
    if n == 0:
        return 0.0
    return _time(n, float(sum(lengths)), float(max(lengths)), latency, max_batch_size)


def _time(n: int, total: float, longest: float, latency: LatencyModel, cap: int | None) -> float:
    if n == 0:
        return 0.0
    bs = min(n, cap or latency.max_batch_size)
    return latency.seconds_per_token(bs) * max(total / bs, longest)


class _Load:
    """One instance's unfinished predicted lengths, with O(log n) add/remove."""

    def __init__(self, lengths: Sequence[float]) -> None:
        self.sorted = sorted(float(x) for x in lengths)
        self.total = float(sum(self.sorted))

    def time(self, latency: LatencyModel, cap: int | None, add: float | None = None, remove: float | None = None) -> float:
        n, total = len(self.sorted), self.total
        longest = self.sorted[-1] if self.sorted else 0.0
        if remove is not None:
            n, total = n - 1, total - remove
            if self.sorted and remove == longest:
                longest = self.sorted[-2] if len(self.sorted) > 1 else 0.0
        if add is not None:
            n, total, longest = n + 1, total + add, max(longest, add)
        return _time(n, total, longest, latency, cap)

    def remove(self, x: float) -> None:
        del self.sorted[bisect.bisect_left(self.sorted, x)]
        self.total -= x

    def add(self, x: float) -> None:
        bisect.insort(self.sorted, x)
        self.total += x


def plan_moves(
    unfinished: Mapping[str, Sequence[tuple[str, float]]],
    movable: Mapping[str, Sequence[str]],
    latency: LatencyModel,
    max_batch_size: int | None = None,
    threshold: float = 0.25,
    max_moves: int = 1_000_000,
    room: Mapping[str, int] | None = None,
) -> list[Move]:
    """Moves that even out the instances' predicted remaining time (``remaining_time_s``).

    While the most loaded instance's ``T`` exceeds the least loaded one's by more than
    ``threshold * T_max``, move one movable request from the most to the least loaded: the one
    that minimises ``max(T_src, T_dst)`` afterwards. Stop when no move lowers that maximum, or
    after ``max_moves``. With ``room`` (the SGS passes each instance's free batch slots) an
    instance receives at most that many requests in one round: work stealing, where what moves
    starts at once. Without it a round can pile a queue onto the destination on the strength of
    predictions alone, which with an often wrong ranker leaves the destination last.

    ``unfinished[name]``: ``(request_id, predicted remaining length)`` of every unfinished request
    on that instance; ``movable[name]``: the ids among them that may move. Every instance must
    appear in ``unfinished`` (with ``[]`` if idle). ``room[name]``: how many requests that
    instance may receive (None: no limit).
    """
    if not 0.0 <= threshold < 1.0:
        raise ValueError(f"rebalance threshold={threshold!r}: must be in [0, 1) (a fraction of the largest load)")
    if max_moves < 0:
        raise ValueError(f"max_moves={max_moves!r} must be >= 0")
    pred, loads, queued, left = _checked_state(unfinished, movable, room)
    moves: list[Move] = []
    if len(loads) < 2:
        return moves
    while len(moves) < max_moves:
        times = {name: load.time(latency, max_batch_size) for name, load in loads.items()}
        src = max(times, key=lambda k: (times[k], k))
        takers = [k for k in times if k != src and (left is None or left[k] > 0)]
        if not takers:
            break
        dst = min(takers, key=lambda k: (times[k], k))
        if times[src] - times[dst] <= threshold * times[src] or not queued.get(src):
            break
        best = _best_move(queued[src], pred, loads[src], loads[dst], latency, max_batch_size)
        if best is None or best[0] >= times[src] - 1e-12:
            break  # no single move shortens the makespan
        rid = best[1]
        queued[src].remove(rid)
        queued.setdefault(dst, []).append(rid)
        loads[src].remove(pred[rid])
        loads[dst].add(pred[rid])
        if left is not None:
            left[dst] -= 1
        moves.append(Move(rid, src, dst, pred[rid]))
    return moves


def _best_move(candidates: Sequence[str], pred: Mapping[str, float], src: "_Load", dst: "_Load",
               latency: LatencyModel, max_batch_size: int | None) -> tuple[float, str] | None:
    """``(makespan of the pair after the move, request)`` of the candidate that lowers it most;
    candidates of equal length are tried once."""
    best: tuple[float, str] | None = None
    tried: set[float] = set()
    for rid in candidates:
        x = pred[rid]
        if x in tried:
            continue
        tried.add(x)
        after = max(src.time(latency, max_batch_size, remove=x), dst.time(latency, max_batch_size, add=x))
        if best is None or after < best[0]:
            best = (after, rid)
    return best


def _checked_state(unfinished, movable, room):
    """Validate ``plan_moves``' inputs; returns its working state: predicted length per request,
    load per instance, movable ids per instance, and room left per instance (None: no limit)."""
    unknown = sorted(set(movable) - set(unfinished))
    if unknown:
        raise ValueError(f"movable names instances {unknown} that are not in unfinished {sorted(unfinished)}")
    pred: dict[str, float] = {}
    loads: dict[str, _Load] = {}
    for name, reqs in unfinished.items():
        for rid, length in reqs:
            if not length >= 0:
                raise ValueError(f"request {rid!r} on {name!r}: predicted length {length!r} must be >= 0")
            pred[rid] = float(length)
        loads[name] = _Load([float(length) for _, length in reqs])
    queued: dict[str, list[str]] = {}
    for name, ids in movable.items():
        owned = {rid for rid, _ in unfinished[name]}
        stray = [rid for rid in ids if rid not in owned]
        if stray:
            raise ValueError(f"movable requests {stray[:5]} are not unfinished on instance {name!r}")
        queued[name] = list(ids)
    left = None if room is None else {name: int(room.get(name, 0)) for name in loads}
    if left is not None and any(v < 0 for v in left.values()):
        raise ValueError(f"room={dict(room)}: counts must be >= 0")
    return pred, loads, queued, left

def has_free_slots(counts: Mapping[str, int], max_batch_size: int) -> bool:
    """Whether a rebalancing check can act at all: two or more instances, one of them with fewer
    unfinished requests than a full batch, and one with at least two (something to split)."""
    return len(counts) >= 2 and min(counts.values()) < max_batch_size and max(counts.values()) >= 2


def plan_round(instances: Mapping[str, Sequence[Unfinished]], latency: LatencyModel, max_batch_size: int,
               threshold: float = 0.25, recent: Sequence[float] = (),
               receivers: Collection[str] | None = None) -> list[Move]:
    """One rebalancing check over every instance's unfinished requests.

    It acts only while some instance has free batch slots (fewer unfinished requests than
    ``max_batch_size``: it runs under-full or idles, the moment a wrong estimate shows) and some
    instance has two or more requests (``has_free_slots``); each request's remaining length
    comes from ``remaining_estimate``; nothing moves unless the predicted remaining times differ
    by more than ``threshold`` of the largest; then ``plan_moves`` with each instance's free
    slots as its ``room``. A running request predicted to finish within ``MIN_MOVE_TOKENS`` is
    not moved (stopping it would cost more than it saves).

    ``recent``: recent output lengths, sorted (``remaining_estimate``'s overshoot). ``receivers``:
    the instances that may take requests (None: any with free slots; the simulator passes the one
    whose event it handles). Returns the moves to apply; the caller stops each at its source and
    starts it at its destination."""
    counts = {name: len(reqs) for name, reqs in instances.items()}
    if not has_free_slots(counts, max_batch_size):
        return []
    unfinished: dict[str, list[tuple[str, float]]] = {}
    movable: dict[str, list[str]] = {}
    for name, reqs in instances.items():
        unfinished[name], movable[name] = [], []
        for u in reqs:
            left = remaining_estimate(u.predicted, u.generated, u.budget, recent)
            unfinished[name].append((u.request_id, left))
            if u.may_move and (not u.started or left >= MIN_MOVE_TOKENS):
                movable[name].append(u.request_id)
    times = [remaining_time_s([x for _, x in reqs], latency, max_batch_size) for reqs in unfinished.values()]
    if max(times) - min(times) <= threshold * max(times):
        return []
    room = {name: max(0, max_batch_size - n) if receivers is None or name in receivers else 0
            for name, n in counts.items()}  # work stealing: what moves starts at once
    return plan_moves(unfinished, movable, latency, max_batch_size, threshold, room=room)

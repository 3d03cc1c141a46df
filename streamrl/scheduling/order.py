"""In-instance admission order (PAPER.md §3.7, "within an instance").

When an instance is given more prompts than fit in one batch, the order policy decides which are
admitted first: ``fifo`` (arrival order), ``lpt`` (longest predicted first) and ``lpt-head``
(ours: LPT for the head predicted longest, then arrival order; see ``HedgedLptOrder``).

Interface: ``policy.order(predicted_lengths) -> list[int]``, the indices in admission order, and
``policy.priorities(lengths)``, one priority per request for the live engines, which admit by
priority (larger first, ties in arrival order) so requests submitted in different calls still
interleave. Invariant: admitting by ``priorities`` reproduces ``order`` for one call (and the LPT
rule across calls: whenever a slot frees, the longest predicted request waiting goes next).
"""

from __future__ import annotations

from typing import Protocol, Sequence


class OrderPolicy(Protocol):
    name: str

    def order(self, predicted_lengths: Sequence[float]) -> list[int]:
        """Indices of ``predicted_lengths`` in the order they should be admitted."""
        ...

    def priorities(self, predicted_lengths: Sequence[float]) -> list[float]:
        """Admission priority per request for a priority-queue engine (larger first, ties FIFO)."""
        ...


class FifoOrder:
    """Arrival order."""

    name = "fifo"

    def order(self, predicted_lengths: Sequence[float]) -> list[int]:
        return list(range(len(predicted_lengths)))

    def priorities(self, predicted_lengths: Sequence[float]) -> list[float]:
        return [0.0] * len(predicted_lengths)  # all tied: the engine keeps arrival order


class LptOrder:
    """Longest predicted first (Longest Processing Time first, a 4/3-approximation of the
    makespan on identical machines; here the "machines" are the batch slots). The best order
    with exact lengths: choose it for an oracle or a near-perfect ranker."""

    name = "lpt"

    def order(self, predicted_lengths: Sequence[float]) -> list[int]:
        # Stable on ties, so equal predictions keep arrival order.
        return sorted(range(len(predicted_lengths)), key=lambda i: -predicted_lengths[i])

    def priorities(self, predicted_lengths: Sequence[float]) -> list[float]:
        out = [float(x) for x in predicted_lengths]
        bad = [x for x in out if x != x or x < 0]
        if bad:
            raise ValueError(f"predicted lengths must be >= 0 and not NaN for LPT priorities, got {bad[:5]}")
        return out


class HedgedLptOrder:
    """Longest predicted first for the ``head`` fraction predicted longest, then the rest in
    arrival order. Full LPT trusts the whole ranking: every request the ranker predicts short is
    admitted last, so the long ones it missed start last and finish last, after everything else;
    with an imperfect ranker that can make LPT worse than FIFO (``bench scheduling``). Hedged,
    the confident head still starts first and a missed long request starts at a random point of
    the queue instead of at its end."""

    name = "lpt-head"

    def __init__(self, head: float = 0.1) -> None:
        if not 0.0 < head <= 1.0:
            raise ValueError(f"lpt-head: head={head!r} must be in (0, 1] (the fraction admitted longest-first)")
        self.head = head

    def _split(self, predicted_lengths: Sequence[float]) -> tuple[list[int], set[int]]:
        n = len(predicted_lengths)
        k = min(n, max(1, round(self.head * n))) if n else 0
        top = LptOrder().order(predicted_lengths)[:k]
        return top, set(top)

    def order(self, predicted_lengths: Sequence[float]) -> list[int]:
        top, in_top = self._split(predicted_lengths)
        return top + [i for i in range(len(predicted_lengths)) if i not in in_top]

    def priorities(self, predicted_lengths: Sequence[float]) -> list[float]:
        lpt = LptOrder().priorities(predicted_lengths)  # validates
        _, in_top = self._split(predicted_lengths)
        return [1.0 + x if i in in_top else 0.0 for i, x in enumerate(lpt)]


ORDER_POLICIES: dict[str, type] = {"fifo": FifoOrder, "lpt": LptOrder, "lpt-head": HedgedLptOrder}


def make_order_policy(name: str, head: float = 0.1) -> OrderPolicy:
    """The order policy called ``name`` (``head``: the LPT fraction of ``lpt-head``); unknown
    names raise ``ValueError`` listing the known ones."""
    if name not in ORDER_POLICIES:
        raise ValueError(f"unknown order policy {name!r}; known: {sorted(ORDER_POLICIES)}")
    return HedgedLptOrder(head) if name == "lpt-head" else ORDER_POLICIES[name]()

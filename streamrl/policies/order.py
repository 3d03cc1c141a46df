"""In-instance admission order (PAPER.md §3.7, "within an instance").

When an instance is given more prompts than fit in one batch, the order policy decides which are
admitted first. Each time a running sequence finishes, the engine admits the next one in this
order.

- ``fifo``: arrival order.
- ``lpt``: longest predicted first (Longest Processing Time first, a 4/3-approximation of the
  makespan on identical machines; here the "machines" are the batch slots).

Interface: ``policy.order(predicted_lengths) -> list[int]``, the indices in admission order.
The live engines admit by a per-request priority (larger first, ties in arrival order) so that
requests submitted in different calls still interleave correctly; ``policy.priorities(lengths)``
gives those priorities, and admitting by them reproduces ``order`` for one call (and the LPT rule
across calls: whenever a slot frees, the longest predicted request waiting goes next).
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
    name = "fifo"

    def order(self, predicted_lengths: Sequence[float]) -> list[int]:
        return list(range(len(predicted_lengths)))

    def priorities(self, predicted_lengths: Sequence[float]) -> list[float]:
        return [0.0] * len(predicted_lengths)  # all tied: the engine keeps arrival order


class LptOrder:
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


ORDER_POLICIES: dict[str, type] = {"fifo": FifoOrder, "lpt": LptOrder}


def make_order_policy(name: str) -> OrderPolicy:
    """The order policy called ``name``; unknown names raise ``ValueError`` listing the known ones."""
    try:
        return ORDER_POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown order policy {name!r}; known: {sorted(ORDER_POLICIES)}") from None

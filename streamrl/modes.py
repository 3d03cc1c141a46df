"""The four pipeline modes, defined once: the config's choices, the live controller and the
simulator's systems all read them from here.

    mode          resources        what overlaps                                  staleness
    colocated     one worker       nothing (generate, then train: time-shared)    0
    disagg-batch  separate         nothing (generate the batch, train, push)      0
    stream-sync   separate         training on finished samples during generation 0
    stream-async  separate         generation of i+1 with training of i            1
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModeSpec:
    name: str
    colocated: bool
    """Generation and training time-share one worker (else: separate resources, the SGS)."""
    streaming: bool
    """Finished samples go to the trainer while the batch still generates (dynamic batches)."""
    max_staleness: int
    """Versions a trained sample may lag the trainer: 0 synchronous, 1 one-step asynchronous."""

    @property
    def pipeline(self) -> str:
        """The simulator's name for the overlap: ``batch``, ``stream`` or ``async``."""
        if self.max_staleness > 0:
            return "async"
        return "stream" if self.streaming else "batch"


MODES: dict[str, ModeSpec] = {m.name: m for m in (
    ModeSpec("colocated", colocated=True, streaming=False, max_staleness=0),
    ModeSpec("disagg-batch", colocated=False, streaming=False, max_staleness=0),
    ModeSpec("stream-sync", colocated=False, streaming=True, max_staleness=0),
    ModeSpec("stream-async", colocated=False, streaming=True, max_staleness=1),
)}
MODE_NAMES: tuple[str, ...] = tuple(MODES)


def get_mode(name: str) -> ModeSpec:
    try:
        return MODES[name]
    except KeyError:
        raise ValueError(f"unknown mode {name!r}; known: {list(MODES)}") from None

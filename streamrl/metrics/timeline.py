"""Timeline of stage events: who did what, for which iteration and policy version, when.

Each component (trainer actor, generation instance, driver) records ``Event``s into its own
``Timeline`` (``tl.add(...)`` or ``with tl.span(...)``); actors return ``tl.events()``, the driver
merges them (``driver_tl.extend(events)``) and at the end of a run writes ``tl.to_json(path)``,
``gantt(tl, png)`` and ``tl.summary()`` (metrics). Invariants: a ``Timeline`` is thread-safe;
after ``spill_to`` no event stays in memory, so the driver's memory stays flat however long the
run; times are ``time.time()`` (wall clock), so events of processes on one node line up (across
nodes, as well as the nodes' clocks are synced), and ``Timeline.t0`` (the earliest start) is the
origin of pictures and summaries. Event kinds: ``STANDARD_KINDS``; busy fractions: ``NOT_BUSY``.
"""

from __future__ import annotations

import json
import re
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path
from typing import Any, Iterable, Iterator

from streamrl.types import Event  # noqa: F401  (the record; re-exported for callers of the timeline)

STANDARD_KINDS = ("generate", "train", "prepare", "weight_push", "weight_fetch", "weight_load", "checkpoint", "eval",
                  "idle")
"""The ``what`` kinds with fixed colours in the Gantt picture (an open set): ``generate`` (an
instance decoding), ``train`` (an optimizer step or a mini-batch), ``prepare`` (per-sample work:
old/ref log-probs, values, rewards), ``weight_push`` (flatten + publish on the trainer),
``weight_fetch`` (an instance receiving a version while it keeps generating; ``meta``: bytes, full
or delta, source, link), ``weight_load`` (the copy into the instance's parameters: the engine's
pause), ``checkpoint``, ``eval``, ``idle`` (an explicit wait)."""
NOT_BUSY = frozenset({"idle", "weight_fetch"})
"""Kinds that busy fractions ignore: ``weight_fetch`` is a transfer, not work of the instance's
cores. Gaps with no event are idle too."""


class Timeline:
    """A thread-safe list of events; merge others' lists with ``extend``."""

    def __init__(self, events: Iterable[Event] = ()) -> None:
        self._lock = threading.Lock()
        self._events: list[Event] = list(events)
        self._spill: Path | None = None
        self._count = len(self._events)

    def spill_to(self, path: str | Path) -> None:
        """Keep events in ``path`` (JSON lines, appended as they arrive) instead of in memory;
        the events held so far go first. Reads (``events()``, ``summary()``) load the file;
        ``unspill()`` brings the events back for reporting. A long run's driver calls this."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            path.write_text("".join(json.dumps(asdict(e)) + "\n" for e in self._events))
            self._spill = path
            self._events = []

    def unspill(self) -> None:
        """Back to memory: read the spill file's events in and remove the file."""
        with self._lock:
            if self._spill is None:
                return
            path, self._spill = self._spill, None
            self._events = [Event(**json.loads(line)) for line in path.read_text().splitlines() if line]
            path.unlink()

    def _append(self, events: list[Event]) -> None:
        # caller holds self._lock
        self._count += len(events)
        if self._spill is None:
            self._events.extend(events)
        elif events:
            with self._spill.open("a") as f:
                f.write("".join(json.dumps(asdict(e)) + "\n" for e in events))

    def add(self, who: str, what: str, iteration: int, version: int, start: float, end: float, **meta) -> Event:
        ev = Event(who, what, iteration, version, start, end, meta)
        with self._lock:
            self._append([ev])
        return ev

    @contextmanager
    def span(self, who: str, what: str, iteration: int, version: int, **meta) -> Iterator[dict]:
        """Time the body; keys the body puts into the yielded dict land in the event's meta."""
        extra: dict[str, Any] = dict(meta)
        start = time.time()
        try:
            yield extra
        finally:
            self.add(who, what, iteration, version, start, time.time(), **extra)

    def extend(self, events: Iterable[Event]) -> None:
        events = list(events)
        bad = [e for e in events if not isinstance(e, Event)]
        if bad:
            raise TypeError(f"Timeline.extend got {len(bad)} non-Event items, first: {bad[0]!r}")
        with self._lock:
            self._append(events)

    def events(self) -> list[Event]:
        """A copy, sorted by start time."""
        with self._lock:
            if self._spill is None:
                evs = list(self._events)
            else:
                evs = [Event(**json.loads(line)) for line in self._spill.read_text().splitlines() if line]
        return sorted(evs, key=lambda e: (e.start, e.end))

    def __len__(self) -> int:
        with self._lock:
            return self._count

    @property
    def t0(self) -> float:
        evs = self.events()
        return min(e.start for e in evs) if evs else 0.0

    @property
    def t1(self) -> float:
        evs = self.events()
        return max(e.end for e in evs) if evs else 0.0

    def rows(self) -> list[str]:
        """Every ``who``: the trainer first, then the rest in natural order (gen-2 before gen-10)."""
        return sort_rows({e.who for e in self.events()})

    def to_json(self, path: str | Path) -> None:
        data = {"t0": self.t0, "events": [asdict(e) for e in self.events()]}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1))

    @classmethod
    def from_json(cls, path: str | Path) -> "Timeline":
        """Read ``to_json``'s file, or a ``spill_to`` file (``.jsonl``)."""
        text = Path(path).read_text()
        if Path(path).suffix == ".jsonl":
            return cls(Event(**json.loads(line)) for line in text.splitlines() if line)
        return cls(Event(**d) for d in json.loads(text)["events"])

    def summary(self, t0: float | None = None, t1: float | None = None) -> dict[str, float]:
        """``busy/<who>`` (any non-idle work) and ``busy/<who>/<what>`` fractions of [t0, t1]
        (default: the whole timeline), plus ``timeline/wall_s``."""
        evs = self.events()
        t0 = self.t0 if t0 is None else t0
        t1 = self.t1 if t1 is None else t1
        out: dict[str, float] = {"timeline/wall_s": t1 - t0}
        for who in self.rows():
            kinds = sorted({e.what for e in evs if e.who == who})
            out[f"busy/{who}"] = busy_fraction(evs, who, [k for k in kinds if k not in NOT_BUSY], t0, t1)
            for k in kinds:
                out[f"busy/{who}/{k}"] = busy_fraction(evs, who, [k], t0, t1)
        return out


def sort_rows(names: Iterable[str]) -> list[str]:
    def key(name: str):
        parts = re.split(r"(\d+)", name)
        return (0 if name.startswith("trainer") else 1, [int(p) if p.isdigit() else p for p in parts])

    return sorted(names, key=key)


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Union of intervals as sorted, disjoint ``(start, end)`` pairs (touching ones are joined)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def busy_fraction(
    events: Iterable[Event], who: str, kinds: Iterable[str] | None, t0: float, t1: float
) -> float:
    """Fraction of [t0, t1] covered by ``who``'s events of ``kinds`` (None: all but idle),
    overlapping events counted once."""
    if not t1 > t0:
        raise ValueError(f"busy_fraction needs t1 > t0, got t0={t0} t1={t1}")
    kinds = None if kinds is None else set(kinds)
    clipped = [
        (max(e.start, t0), min(e.end, t1))
        for e in events
        if e.who == who and (e.what in kinds if kinds is not None else e.what not in NOT_BUSY)
    ]
    covered = sum(e - s for s, e in merge_intervals((s, e) for s, e in clipped if e > s))
    return covered / (t1 - t0)


# ---------------------------------------------------------------- Gantt picture

COLOURS = {
    "generate": "#4C72B0",
    "train": "#DD8452",
    "prepare": "#E6C229",
    "weight_push": "#8E44AD",
    "weight_fetch": "#D7BDE2",
    "weight_load": "#C39BD3",
    "eval": "#55A868",
    "idle": "#E0E0E0",
}
_SPARE = ["#C44E52", "#64B5CD", "#8C8C8C", "#937860", "#DA8BC3", "#CCB974"]
THIN = frozenset({"prepare", "weight_push", "weight_fetch", "weight_load"})
"""Drawn in the lower part of the row, over the full-height bars, so overlap stays visible."""


def gantt(timeline: Timeline, path_png: str | Path, title: str = "", rows: list[str] | None = None) -> list[str]:
    """Write a Gantt PNG (one row per ``who``, bars coloured by ``what``, dashed lines where
    iterations' generation starts, x in seconds from the first event); returns the row order,
    top to bottom.
    Row labels carry each row's busy fraction."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    evs = timeline.events()
    if not evs:
        raise ValueError(f"gantt({path_png}): the timeline has no events")
    rows = list(rows) if rows is not None else timeline.rows()
    unknown_rows = sorted({e.who for e in evs} - set(rows))
    if unknown_rows:
        raise ValueError(f"gantt: events for rows {unknown_rows} not in rows={rows}")
    t0, t1 = timeline.t0, timeline.t1
    kinds = [k for k in STANDARD_KINDS if any(e.what == k for e in evs)]
    kinds += sorted({e.what for e in evs} - set(STANDARD_KINDS))
    spare = iter(_SPARE * 10)
    colour = {k: COLOURS.get(k) or next(spare) for k in kinds}

    fig, ax = plt.subplots(figsize=(12, max(2.5, 1.2 + 0.55 * len(rows))))
    for y, who in enumerate(rows):
        mine = [e for e in evs if e.who == who]
        ordered = sorted({e.what for e in mine}, key=lambda k: (k != "idle", k in THIN))
        for k in ordered:
            spans = merge_intervals((e.start - t0, e.end - t0) for e in mine if e.what == k)
            bars = [(s, max(e - s, 1e-9)) for s, e in spans]
            ybox = (y + 0.05, 0.3) if k in THIN else (y - 0.38, 0.76)
            ax.broken_barh(bars, ybox, facecolors=colour[k], edgecolor="none", zorder=3 if k in THIN else 2)

    # An iteration starts when its generation starts (in async modes the trainer's work for
    # iteration i runs during generation of i+1); iterations without generation use any event.
    starts: dict[int, float] = {}
    for e in sorted(evs, key=lambda e: e.what != "generate"):
        if e.iteration >= 0 and (e.what == "generate" or e.iteration not in starts):
            starts[e.iteration] = min(starts.get(e.iteration, e.start), e.start)
    every = max(1, len(starts) // 20)
    for i, (it, s) in enumerate(sorted(starts.items())):
        ax.axvline(s - t0, color="#555555", lw=0.6, ls="--", zorder=1)
        if i % every == 0:
            ax.text(s - t0, -0.55, f" it {it}", fontsize=8, color="#333333", ha="left", va="bottom")

    busy = timeline.summary(t0, t1) if t1 > t0 else {}
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"{w}  {100 * busy.get(f'busy/{w}', 0.0):.0f}%" for w in rows])
    ax.set_ylim(len(rows) - 0.4, -0.7)
    ax.set_xlim(0, max(t1 - t0, 1e-6) * 1.01)
    ax.set_xlabel("seconds from run start (row label: busy % of wall time; gaps are idle)")
    ax.grid(axis="x", color="#EEEEEE", zorder=0)
    ax.set_title(title or "timeline")
    ax.legend(handles=[Patch(color=colour[k], label=k) for k in kinds], loc="upper center",
              bbox_to_anchor=(0.5, -0.18 - 0.2 / max(1, len(rows))), ncol=len(kinds), fontsize=8, frameon=False)
    fig.tight_layout()
    Path(path_png).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path_png, dpi=110)
    plt.close(fig)
    return rows

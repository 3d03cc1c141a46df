"""Runtime rebalancing in the SGS (beyond the paper; the rule is ``scheduling.rebalance``).

Instances then hold submitted requests in their own queue and give the engine a batch plus a
little slack, so queued work stays movable. At most every ``generation.rebalance_interval_s``,
and only while some instance has free batch slots, ``plan_round`` compares predicted remaining
times and plans moves; the source ``preempt``s each (a queued request moves as it is, a running
one, with ``generation.rebalance_running``, at most once, continues from prompt + prefix) and the
ledger joins the two parts into one ``Completion``. Never lost, never run twice.
"""

from __future__ import annotations

import time

from streamrl.scheduling.rebalance import Unfinished, has_free_slots, plan_round
from streamrl.sgs.ledger import Record
from streamrl.types import GenRequest, Partial, Progress


class Rebalancing:
    """Mixed into ``StreamGenerationService``: reads its ``pool``, ``ledger``, ``latency`` and counters."""

    def _maybe_rebalance(self) -> int:
        """Move requests off an instance whose predicted remaining time is far above another's
        while some instance has free slots; returns how many moved."""
        now = time.perf_counter()
        if len(self.pool) < 2 or now - self._last_check < self.rebalance_interval_s:
            return 0
        self._last_check = now
        cap = self.cfg.generation.max_requests_per_batch
        counts = {n: c for n, c in self.ledger.counts(self.pool).items() if n in self.pool and not self.pool[n].retiring}
        if len(counts) < 2 or not has_free_slots(counts, cap):
            return 0  # every instance has a full batch of work, or there is nothing to split: no Ray call
        missing = [n for n in counts if self.pool[n].progress is None]  # not polled yet since it got work
        for name, prog in self._gather({n: self.pool[n].actor.progress.remote() for n in missing}, "progress").items():
            self._set_progress(name, prog)
        names = [n for n in counts if n in self.pool]  # without any instance failed over just now
        if len(names) < 2:
            return 0
        moves = plan_round(self._unfinished({n: self.pool[n].progress for n in names}), self.latency, cap,
                           self.rebalance_threshold, sorted(self._recent))
        return self._apply_moves(moves) if moves else 0

    def _set_progress(self, name: str, progress: Progress | None) -> None:
        if name in self.pool:
            self.pool[name].progress = progress
            if progress is not None:
                self.ledger.running(progress.running, name)

    def _unfinished(self, states: dict[str, Progress]) -> dict[str, list[Unfinished]]:
        """Per instance, its unfinished requests as ``plan_round`` reads them: progress from the
        instances' states; movable if not started (held here, or queued in an engine that preempts),
        or running on an engine that preempts, with ``rebalance_running``, and not moved before."""
        out: dict[str, list[Unfinished]] = {name: [] for name in states}
        sets = {n: (set(st.held), set(st.waiting), st.running, st.preempt) for n, st in states.items()}
        for rec in self.ledger.in_flight():
            if rec.instance not in sets:  # an instance being retired: its last requests stay where they are
                continue
            out[rec.instance].append(self._as_unfinished(rec, *sets[rec.instance]))
        return out

    def _as_unfinished(self, rec: Record, held: set, waiting: set, running: dict, can_preempt: bool) -> Unfinished:
        rid = rec.request.request_id
        started = rid in running
        may_move = (rid in held or (rid in waiting and can_preempt)
                    or (started and can_preempt and self.rebalance_running and not rec.moved_running))
        return Unfinished(rid, rec.predicted, rec.generated + running.get(rid, 0), rec.request.max_new_tokens,
                          started, may_move)

    def _apply_moves(self, moves) -> int:
        """Preempt each move's request at its source and re-submit it (or its continuation) at its destination."""
        dst_of = {m.request_id: m.dst for m in moves}
        by_src: dict[str, list[str]] = {}
        for m in moves:
            by_src.setdefault(m.src, []).append(m.request_id)
        stopped = self._gather({src: self.pool[src].actor.preempt.remote(ids, self.rebalance_running)
                                for src, ids in by_src.items() if src in self.pool}, "preempt")
        per_dst: dict[str, list[GenRequest]] = {}
        for parts in stopped.values():
            for part in parts:  # only requests the source stopped: none can also finish there
                per_dst.setdefault(dst_of[part.request.request_id], []).append(self._continuation(part))
        lost_dst = [req for dst, reqs in per_dst.items() if dst not in self.pool for req in reqs]
        per_dst = {dst: reqs for dst, reqs in per_dst.items() if dst in self.pool}
        for dst, reqs in per_dst.items():
            for req in reqs:
                self.ledger.sent(req, dst)
        self._gather({dst: self.pool[dst].actor.submit.remote(reqs) for dst, reqs in per_dst.items()}, "submit")
        self._redispatch(lost_dst)  # a destination failed over meanwhile: these go through dispatch instead
        moved = sum(len(reqs) for reqs in per_dst.values())
        self.counters["sgs/rebalanced"] += moved
        self.counters["sgs/rebalance_rounds"] += 1
        return moved

    def _continuation(self, part: Partial) -> GenRequest:
        """The request to send on for a preempted ``part`` (the ledger keeps its prefix)."""
        if part.output_ids:
            self.counters["sgs/rebalanced_running"] += 1
        return self.ledger.preempted(part)

"""Fault handling of the SGS: every call to an instance, its heartbeat, and fail-over.

An instance whose actor died, that answers no call within ``generation.heartbeat_timeout_s``, or
that has work but generates no token for that long is killed and removed (``_fail``); its
unfinished requests go back through dispatch (from their joined prefix if they had moved), and
with ``generation.restart`` a replacement that installs the current weights first is started,
within ``generation.max_restarts``. No instance left: ``GenerationFailed``. A weight buffer whose
owner (the trainer) is gone: ``TrainerFailed``; one whose owner was a relay instance: fetched from
the trainer instead (``_gather_tree``). Each fault is a record appended to ``fault_log``.
"""

from __future__ import annotations

import json
import logging
import time

import ray

from streamrl.errors import GenerationFailed, TrainerFailed
from streamrl.weights.tree import levels

log = logging.getLogger(__name__)


class FaultTolerance:
    """Mixed into ``StreamGenerationService``: reads its ``pool``, ``ledger``, ``counters``, ``faults``."""

    def _gather(self, refs: dict[str, ray.ObjectRef], what: str) -> dict[str, object]:
        """The results of one call per instance (``{name: ref}``); an instance that died or did
        not answer within the heartbeat timeout is failed over (``_fail``) and left out."""
        out: dict[str, object] = {}
        deadline = time.perf_counter() + self.heartbeat_s  # one deadline for the whole round
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=max(0.0, deadline - time.perf_counter()))
            except ray.exceptions.GetTimeoutError:
                self._fail(name, f"answered no {what} within generation.heartbeat_timeout_s={self.heartbeat_s:g}s")
            except ray.exceptions.RayActorError as exc:
                self._fail(name, f"died ({type(exc).__name__}) during {what}")
            except ray.exceptions.ObjectLostError as exc:  # OwnerDiedError: the buffer's owner is gone
                raise TrainerFailed(f"{what}: weights version {self.version} are lost, the trainer that "
                                    f"published them died ({type(exc).__name__})") from None
        return out

    def _gather_tree(self, refs: dict, parents: dict[str, str | None], handle, version: int) -> list[dict]:
        """Each instance's update result, parents first; an instance whose relay failed (and was
        failed over) fetches from the trainer instead, so one dead relay costs no other instance."""
        what = f"weight update to version {version}"

        def from_trainer(name: str) -> dict:
            return {name: self.pool[name].actor.update.remote(handle, version, False)}

        failed: set[str] = set()
        out = []
        for level in levels(parents):
            for name in level:
                if name not in self.pool:
                    failed.add(name)
                    continue
                relay_failed = parents[name] in failed
                try:
                    got = self._gather(from_trainer(name) if relay_failed else {name: refs[name]}, what)
                except TrainerFailed:
                    if parents[name] is None or relay_failed:  # the trainer's own buffers are gone
                        raise
                    # The relay above it died after publishing: its copy went with it, not the
                    # trainer's. Fetch from the trainer (its own children follow the same way).
                    self.counters["sgs/relay_fallbacks"] += 1
                    got = self._gather(from_trainer(name), what)
                if name in got:
                    out.append(got[name])
                else:
                    failed.add(name)
        return out

    def _new_fault(self, instance: str, reason: str, requeued: int) -> dict:
        """Count, record and log one fault; the record is filled in when a replacement is up."""
        self.counters["sgs/faults"] += 1
        record = {"fault": len(self.faults), "instance": instance, "reason": reason, "time": time.time(),
                  "requeued": requeued, "replacement": None, "replaced_at": None}
        self.faults.append(record)
        self._log_fault(record)
        return record

    def _log_fault(self, record: dict) -> None:
        """Append the record to ``fault_log`` now (a driver killed a moment later loses nothing);
        a record is written again when its replacement is up: the last line of a fault wins."""
        if self.fault_log:
            with open(self.fault_log, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _check_progress(self, now: float) -> None:
        """Fail over an instance that has unfinished requests but has generated no token for the
        heartbeat timeout while still answering (its engine stopped stepping). Read every quarter
        of the timeout, only from instances with work."""
        self._live_checked = now
        busy = {n for n, c in self.ledger.counts(self.pool).items() if c}
        for name, inst in self.pool.items():
            if name not in busy:
                inst.live = None  # idle: its clock starts again when it gets work
        values = self._gather({n: self.pool[n].actor.liveness.remote() for n in busy if n in self.pool}, "liveness")
        for name, value in values.items():
            inst = self.pool.get(name)
            if inst is None:
                continue
            if inst.live is None or inst.live[0] != value:
                inst.live = (value, now)
            elif now - inst.live[1] > self.heartbeat_s:
                stalled, inst.live = now - inst.live[1], None
                self._fail(name, f"generated no token for {stalled:.0f}s with work queued "
                                 f"(generation.heartbeat_timeout_s={self.heartbeat_s:g}s)")

    def _fail(self, name: str, reason: str) -> None:
        """Remove a dead or hung instance, start a replacement if allowed, and re-dispatch its
        unfinished requests (nothing is lost; each still completes exactly once)."""
        if name not in self.pool:
            return
        log.warning("generation instance %s %s: removed, its unfinished requests re-dispatched", name, reason)
        retiring = self.pool[name].retiring
        try:
            ray.kill(self._detach(name))  # a hung process is stopped for good; a dead one is already gone
        except Exception:  # noqa: BLE001 - the actor may be unknown to Ray by now
            pass
        orphans = self.ledger.take_from(name)
        record = self._new_fault(name, reason, len(orphans))
        g = self.cfg.generation
        if not retiring and g.restart and self.counters["sgs/restarts"] < g.max_restarts:
            self.counters["sgs/restarts"] += 1
            try:
                log.warning("starting a replacement for %s (%d of generation.max_restarts=%d)", name,
                            self.counters["sgs/restarts"], g.max_restarts)
                record["replacement"] = self.add_instance()
                record["replaced_at"] = time.time()
                self._log_fault(record)  # again, now with its replacement
            except GenerationFailed as exc:
                if not self.pool:
                    raise
                log.warning("no replacement for %s: %s", name, exc)
        if not self.pool:
            self.ledger.fail_all()
            raise GenerationFailed(
                f"every generation instance is gone (the last, {name}, {reason}); "
                + (f"generation.max_restarts={g.max_restarts} replacements used" if g.restart
                   else "generation.restart is false") + f"; {len(orphans)} requests were unfinished")
        self._redispatch(orphans)
        self.counters["sgs/requeued"] += len(orphans)

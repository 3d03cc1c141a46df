"""The request ledger: one typed record per request the SGS has accepted, and its state.

    queued --send--> dispatched --progress--> running --preempt+send--> moved --complete--> done
       ^                 |                       |                        |
       +---- unassign ---+-----------------------+------------------------+     (instance lost)
    dispatched | running | moved --turn_done--> env --next_turn--> moved | --finish--> done
    any unfinished state --fail_all--> failed (no instance left: the run stops)

Only this module changes a record's state. Invariants: a request is in flight (not done or
failed) in exactly one record; its completion is handed out once (a second one is refused and
counted by the caller); a moved request's earlier output (its prefix) is joined to the
continuation's, so the caller sees one ``Completion`` per request. A multi-turn trajectory is one
request: each finished turn waits in ``env`` for its environment, whose tokens join the prefix
with loss mask 0, and the next turn is a continuation of prompt + prefix.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterable

from streamrl.types import Completion, GenRequest, Partial

RESUME_PRIORITY = 1e30  # a resumed request is admitted before everything queued at its new instance


class State(enum.Enum):
    QUEUED = "queued"  # recorded, at no instance (new, or taken off a lost one)
    DISPATCHED = "dispatched"  # sent to ``instance``, not seen running yet
    RUNNING = "running"  # its instance reported tokens for it
    MOVED = "moved"  # stopped with output at one instance, its continuation sent to another
    ENV = "env"  # a trajectory's turn finished; its environment's answer is awaited
    DONE = "done"  # its completion was handed out
    FAILED = "failed"  # no instance was left to finish it


IN_FLIGHT = (State.QUEUED, State.DISPATCHED, State.RUNNING, State.MOVED, State.ENV)


@dataclass
class Record:
    """One request: as submitted, what its instance holds now, and what it generated before a move."""

    request: GenRequest  # as submitted (its prompt, its full token budget)
    predicted: float  # the length dispatch and rebalancing used
    state: State = State.QUEUED
    instance: str | None = None
    sent: GenRequest | None = None  # what ``instance`` was given: the request, or its continuation
    prefix: Partial | None = None  # everything generated before its preemptions (joined at the end)
    moved_running: bool = False  # moved while running once: never moved again
    last: Completion | None = None  # a trajectory's last finished turn (its finish reason, versions, times)
    turn_instance: str | None = None  # where its last turn ran: the next one goes there (its KV prefix)

    @property
    def generated(self) -> int:
        """Tokens generated before its last move (0 if it never moved with output)."""
        return len(self.prefix.output_ids) if self.prefix else 0


def _join(pre: Partial | None, part, request: GenRequest | None = None) -> Partial:
    """``pre`` followed by ``part``'s output (a ``Partial``, or a ``Completion`` of ``request``), as
    one prefix."""
    if pre is None:
        return Partial(request or part.request, tuple(part.output_ids), tuple(part.logprobs),
                       part.version_start, part.t_start, part.versions(), part.mask())
    return Partial(pre.request, pre.output_ids + tuple(part.output_ids), pre.logprobs + tuple(part.logprobs),
                   min(pre.version_start, part.version_start), pre.t_start, pre.versions() + part.versions(),
                   pre.mask() + part.mask())


class Ledger:
    """The SGS's requests. ``returned`` remembers the ids handed out in the last few batches, so a
    duplicate submit is refused without the ledger growing over a long run."""

    def __init__(self, remember_batches: int = 4) -> None:
        self._records: dict[str, Record] = {}  # in flight, and done ones until their batch ends
        self._returned: set[str] = set()
        self._batches: deque[list[str]] = deque(maxlen=remember_batches)

    # ---------------------------------------------------------------------------- reading
    def known(self, request_id: str) -> bool:
        """In flight, or handed out recently (a resubmission would run it twice)."""
        rec = self._records.get(request_id)
        return (rec is not None and rec.state in IN_FLIGHT) or request_id in self._returned

    def in_flight(self) -> list[Record]:
        return [r for r in self._records.values() if r.state in IN_FLIGHT]

    def pending(self) -> int:
        return sum(r.state in IN_FLIGHT for r in self._records.values())

    def on(self, instance: str) -> list[Record]:
        """The unfinished requests at ``instance``."""
        return [r for r in self.in_flight() if r.instance == instance]

    def counts(self, instances: Iterable[str]) -> dict[str, int]:
        """Unfinished requests per instance, 0 for an idle one."""
        out = {n: 0 for n in instances}
        for r in self.in_flight():
            if r.instance is not None:
                out[r.instance] = out.get(r.instance, 0) + 1
        return out

    def where(self) -> dict[str, str | None]:
        """``request_id -> instance`` of every unfinished request."""
        return {r.request.request_id: r.instance for r in self.in_flight()}

    def record(self, request_id: str) -> Record:
        return self._records[request_id]

    def predicted(self, request_id: str, default: float = 1.0) -> float:
        rec = self._records.get(request_id)
        return rec.predicted if rec is not None else default

    def moved(self) -> list[str]:
        """Requests whose output from an earlier instance is held here (until their completion)."""
        return [r.request.request_id for r in self._records.values() if r.prefix is not None]

    # ---------------------------------------------------------------------------- changing
    def add(self, request: GenRequest, predicted: float) -> Record:
        rec = Record(request, predicted)
        self._records[request.request_id] = rec
        return rec

    def sent(self, request: GenRequest, instance: str) -> None:
        """``request`` (the original with its priority, or a continuation) is now at ``instance``."""
        rec = self._records[request.request_id]
        rec.instance, rec.sent = instance, request
        rec.state = State.MOVED if rec.prefix is not None else State.DISPATCHED

    def running(self, request_ids: Iterable[str], instance: str) -> None:
        """``instance`` reported these requests started (its progress)."""
        for rid in request_ids:
            rec = self._records.get(rid)
            if rec is not None and rec.instance == instance and rec.state is State.DISPATCHED:
                rec.state = State.RUNNING

    def unassign(self, request_id: str) -> GenRequest:
        """Take a request off its instance (lost, retired, or its move's destination lost); returns
        what to send elsewhere (the continuation if it had moved)."""
        rec = self._records[request_id]
        rec.instance, rec.state = None, State.QUEUED
        return rec.sent or rec.request

    def take_from(self, instance: str) -> list[GenRequest]:
        """Unassign every unfinished request at ``instance``."""
        return [self.unassign(r.request.request_id) for r in self.on(instance)]

    def preempted(self, part: Partial) -> GenRequest:
        """A request its instance stopped (``part``): unassigned, and the request to send on: itself
        if it had not started, else prompt + everything generated, with the rest of the budget."""
        rid = part.request.request_id
        rec = self._records[rid]
        rec.instance, rec.state = None, State.QUEUED
        if not part.output_ids:
            rec.sent = part.request
            return part.request
        if rec.prefix is not None:  # preempted before: the earlier prefix comes first
            part = _join(rec.prefix, part)
        rec.prefix, rec.moved_running = part, True
        return self._continue(rec)

    def _continue(self, rec: Record) -> GenRequest:
        """The record's continuation: prompt + prefix, with the rest of its sampled-token budget."""
        req, pre = rec.request, rec.prefix
        rec.sent = replace(req, prompt_ids=tuple(req.prompt_ids) + pre.output_ids,
                           max_new_tokens=req.max_new_tokens - sum(pre.mask()), priority=RESUME_PRIORITY)
        return rec.sent

    def turn_done(self, c: Completion) -> Partial | None:
        """A trajectory's turn finished: its output joins the prefix and it waits for its
        environment (``env``). Returns the trajectory so far, or None for a completion not in flight."""
        rec = self._records.get(c.request_id)
        if rec is None or rec.state not in IN_FLIGHT or rec.state is State.ENV:
            return None
        rec.turn_instance, rec.instance, rec.state, rec.last = c.instance or rec.instance, None, State.ENV, c
        rec.prefix = _join(rec.prefix, c, rec.request)
        return rec.prefix

    def next_turn(self, request_id: str, env_ids: tuple[int, ...]) -> GenRequest:
        """The environment answered: its tokens join the prefix (loss mask 0, the version of the
        token before them) and the next turn is the continuation; it is queued (``sent`` places it)."""
        rec = self._records[request_id]
        pre = rec.prefix
        v = pre.versions()[-1] if pre.output_ids else rec.last.version_end
        n = len(env_ids)
        rec.prefix = replace(pre, output_ids=pre.output_ids + tuple(env_ids), logprobs=pre.logprobs + (0.0,) * n,
                             token_versions=pre.versions() + (v,) * n, loss_mask=pre.mask() + (0,) * n)
        rec.state = State.QUEUED
        return self._continue(rec)

    def finish(self, request_id: str, episode: dict) -> Completion:
        """A trajectory is over: its whole conversation after the prompt, as one completion."""
        rec = self._records[request_id]
        pre, last = rec.prefix, rec.last
        rec.state, rec.instance, rec.prefix = State.DONE, None, None
        self._returned.add(request_id)
        return replace(last, prompt_ids=tuple(rec.request.prompt_ids), output_ids=pre.output_ids,
                       logprobs=pre.logprobs, version_start=pre.version_start, t_start=pre.t_start,
                       token_versions=pre.versions(), loss_mask=pre.mask(), episode=episode)

    def complete(self, c: Completion) -> Completion | None:
        """The request's completion as handed out (prefix joined), or None for one not in flight
        (a duplicate, or never submitted)."""
        rec = self._records.get(c.request_id)
        if rec is None or rec.state not in IN_FLIGHT:
            return None
        rec.state, rec.instance = State.DONE, None
        self._returned.add(c.request_id)
        pre, rec.prefix = rec.prefix, None  # joined now: nothing of it is kept
        if pre is None:
            return c
        whole = _join(pre, c)
        return replace(c, prompt_ids=tuple(pre.request.prompt_ids), output_ids=whole.output_ids, logprobs=whole.logprobs,
                       version_start=whole.version_start, t_start=whole.t_start, token_versions=whole.versions(),
                       loss_mask=whole.loss_mask if 0 in whole.loss_mask else ())

    def end_batch(self, request_ids: list[str], returned_ids: list[str]) -> None:
        """Forget a finished batch's records; remember its ids for the next few batches."""
        for rid in request_ids:
            rec = self._records.get(rid)
            if rec is not None and rec.state not in IN_FLIGHT:
                del self._records[rid]
        self._batches.append(returned_ids)
        if len(self._batches) == self._batches.maxlen:
            self._returned.difference_update(self._batches[0])

    def fail_all(self) -> int:
        """No instance is left: every unfinished request fails; returns how many."""
        recs = self.in_flight()
        for rec in recs:
            rec.state, rec.instance = State.FAILED, None
        return len(recs)

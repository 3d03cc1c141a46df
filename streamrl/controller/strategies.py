"""How a disaggregated pipeline turns one iteration's requests into trained groups.

- ``WholeBatch`` (disagg-batch): generate every request, score, then hand all groups over at once.
- ``Streaming`` (stream-sync, stream-async): each finished group goes to the trainer as it completes.
- ``LookAhead`` (partial rollout): streaming, while later iterations' requests fill free slots.

Each returns ``(samples, last_ref)``: the scored samples in completion order and the trainer's
reference for the iteration's last ``add_groups`` (its ``TrainResult``). Strategies ask the
generation service through its public methods only.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Iterator

import ray

from streamrl.controller.common import units_of
from streamrl.types import Completion, GenRequest, Group

AHEAD_PRIORITY = 1e6
"""Partial rollout: iteration i's requests get priority offset ``-i * AHEAD_PRIORITY``, so an
engine always admits an earlier iteration's request first (order priorities are lengths)."""


class WholeBatch:
    def __init__(self, pipe) -> None:
        self.pipe = pipe  # the DisaggPipeline: its sgs, trainer, ctx and cfg

    def built_ahead(self, iteration: int) -> list[GenRequest] | None:
        """The iteration's requests if they were built and admitted ahead of its step, else None."""
        return None

    def run(self, iteration: int, requests: list[GenRequest], upcoming) -> tuple[list, ray.ObjectRef]:
        p = self.pipe
        samples = [s.sample() for s in [p.ctx.scorer.submit(c, iteration) for c in p.sgs.generate(requests)]]
        groups = units_of(samples, p.cfg.trainer.algo)
        return samples, p.trainer.add_groups.remote(iteration, groups, len(groups))

    def drain(self) -> None:
        """Nothing runs between two iterations."""

    def metrics(self) -> dict[str, float]:
        return {}


class Streaming(WholeBatch):
    def completions(self, iteration: int, requests: list[GenRequest], upcoming) -> Iterator[Completion]:
        return self.pipe.sgs.generate(requests)

    def run(self, iteration: int, requests: list[GenRequest], upcoming) -> tuple[list, ray.ObjectRef]:
        """Stream unit: a finished group for GRPO (advantages need the group), a sample for PPO.
        Finished groups wait in ``outbox`` while the trainer is busy and go in one call as soon
        as it is free: one group at a time when the trainer keeps up, batched per-sample work
        when it does not. Order is kept, so the dynamic-batch cut is the same either way."""
        p = self.pipe
        n = p.cfg.generation.n_samples if p.cfg.trainer.algo == "grpo" else 1
        expected = len({r.prompt_id for r in requests}) if n > 1 else len(requests)
        samples, open_groups, outbox, last_ref = [], {}, [], None
        scoring: deque = deque()  # rewards computing in the reward workers, in completion order

        def take(wait: bool) -> None:  # scored samples, in completion order, into groups and to the trainer
            nonlocal outbox, last_ref
            while scoring and (wait or scoring[0].done()):
                s = scoring.popleft().sample()
                samples.append(s)
                key = s.prompt.prompt_id if n > 1 else s.completion.request_id
                group = open_groups.setdefault(key, [])
                group.append(s)
                if len(group) == n:
                    del open_groups[key]
                    outbox.append(Group.of(sorted(group, key=lambda x: x.sample_idx)))
                if outbox and (last_ref is None or not ray.wait([last_ref], timeout=0)[1]):
                    last_ref = p.trainer.add_groups.remote(iteration, outbox, expected)
                    outbox = []

        for c in self.completions(iteration, requests, upcoming):
            scoring.append(p.ctx.scorer.submit(c, iteration))
            take(wait=False)
        take(wait=True)
        if outbox:
            last_ref = p.trainer.add_groups.remote(iteration, outbox, expected)
        return samples, last_ref


@dataclass
class AheadIteration:
    """One iteration's requests in the SGS, possibly admitted before its own ``step``."""

    iteration: int
    ids: list[str]
    predicted: dict[str, float]  # what dispatch used, per request (for the batch's rank metrics)
    requests: list[GenRequest] = field(default_factory=list)  # as built (a trajectory's reset is not repeated)
    wanted: set[str] = field(default_factory=set)  # not finished yet
    done: list[Completion] = field(default_factory=list)  # finished, in completion order


def owner_of(request_id: str, iterations) -> AheadIteration:
    """The iteration in flight that ``request_id`` belongs to."""
    for it in iterations:
        if request_id in it.wanted:
            return it
    raise RuntimeError(f"completion {request_id!r} belongs to no iteration in flight")


class LookAhead(Streaming):
    """New versions are installed as the trainer publishes them, and later iterations' requests
    (``upcoming``: the next ``lookahead`` batches) are admitted while the SGS has free slots and
    the staleness bound allows (installed version >= that iteration - k: admission control,
    nothing is discarded); each ranks behind every earlier one's, so it only fills slots the
    earlier ones leave free. Their completions wait for their own ``step``."""

    def __init__(self, pipe) -> None:
        super().__init__(pipe)
        self.ahead: dict[int, AheadIteration] = {}  # later iterations' requests, admitted early
        self.admitted = 0  # requests admitted ahead since the last ``metrics``

    def built_ahead(self, iteration: int) -> list[GenRequest] | None:
        state = self.ahead.get(iteration)
        return state.requests if state is not None else None

    def completions(self, iteration: int, requests: list[GenRequest], upcoming) -> Iterator[Completion]:
        p = self.pipe
        ppi = p.cfg.generation.prompts_per_iter
        future = [upcoming[i * ppi:(i + 1) * ppi] for i in range(len(upcoming or []) // ppi)]
        state = self.ahead.pop(iteration, None)
        ids = [r.request_id for r in requests]
        if state is None:
            state = self._admit(iteration, requests)
        elif state.ids != ids:
            raise RuntimeError(f"iteration {iteration}: the requests admitted ahead ({len(state.ids)}) are not "
                               f"this iteration's ({len(ids)})")
        yield from state.done
        while state.wanted:
            p.install_newer()
            self._admit_ahead(iteration, future)
            for c in p.sgs.poll():
                owner = owner_of(c.request_id, [state, *self.ahead.values()])
                owner.wanted.discard(c.request_id)
                owner.done.append(c)
                if owner is state:
                    yield c
        p.sgs.finish_batch(requests, state.predicted, state.done)

    def _admit(self, iteration: int, requests: list[GenRequest]) -> AheadIteration:
        """Submit one iteration's requests; an earlier iteration's always rank first."""
        lengths = self.pipe.sgs.submit(requests, priority_offset=-AHEAD_PRIORITY * iteration)
        ids = [r.request_id for r in requests]
        return AheadIteration(iteration, ids, dict(zip(ids, lengths)), list(requests), set(ids))

    def _admit_ahead(self, iteration: int, future: list) -> None:
        p = self.pipe
        while True:
            nxt = max([iteration, *self.ahead]) + 1
            if (nxt - iteration - 1 >= len(future) or p.sgs.version < nxt - p.max_staleness
                    or p.sgs.pending() >= p.sgs.capacity()):
                return
            self.ahead[nxt] = self._admit(nxt, p.ctx.builder.build(future[nxt - iteration - 1], nxt))
            self.admitted += len(self.ahead[nxt].ids)

    def drain(self) -> None:
        """Let the requests admitted ahead finish (they wait for their ``step``), so a call that
        polls the SGS itself (an evaluation) sees only its own completions."""
        while any(a.wanted for a in self.ahead.values()):
            for c in self.pipe.sgs.poll():
                owner = owner_of(c.request_id, self.ahead.values())
                owner.wanted.discard(c.request_id)
                owner.done.append(c)

    def metrics(self) -> dict[str, float]:
        out = {"gen/admitted_ahead": float(self.admitted), "gen/iterations_ahead": float(len(self.ahead))}
        self.admitted = 0
        return out

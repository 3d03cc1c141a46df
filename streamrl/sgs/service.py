"""The Stream Generation Service (SGS): a pool of generation instances behind two calls.

    update(handle, version)   install policy version ``version`` on every instance
    submit(requests) / poll() (or generate(requests), an iterator): finished samples come back
                              from all instances in completion order, each as it finishes

Dataflow::

    controller --submit--> dispatch policy --> instance k: engine queue (LPT by priority)
    controller <--poll---- ray.wait over one outstanding ``poll`` call per instance; a returned
                           batch is handed out and that instance's poll is re-armed at once

Ownership and exactly-once: the service records every submitted request until its completion
has been handed out. ``remove_instance`` kills an instance and re-submits its unfinished
requests to the remaining ones; a completion that arrives for a request already handed out (or
never submitted) is dropped and counted (``sgs/duplicates``), so every request is returned
exactly once. Instances can be added while requests run; a new instance first installs the
current weights, so it never generates with a stale version.

Placement: each instance is a Ray actor with ``generation.threads_per_instance`` CPUs and the
custom resources in ``generation.resources`` (e.g. ``{"H20": 1}`` on a heterogeneous cluster).
"""

from __future__ import annotations

import itertools
import logging
from typing import Iterator

import ray

from streamrl.config import Config
from streamrl.policies.dispatch import make_dispatch_policy
from streamrl.sgs.instance import GenerationInstance
from streamrl.types import Completion, GenRequest

log = logging.getLogger(__name__)


class StreamGenerationService:
    def __init__(self, cfg: Config, policy_path: str | None = None, dispatch: str = "round-robin",
                 dispatch_kwargs: dict | None = None) -> None:
        self.cfg = cfg
        self.policy_path = policy_path or cfg.policy.path
        self.dispatch = make_dispatch_policy(dispatch, **(dispatch_kwargs or {}))
        self.instances: dict[str, ray.actor.ActorHandle] = {}
        self.assigned: dict[str, tuple[str, GenRequest]] = {}
        self.returned: set[str] = set()
        self._polls: dict[ray.ObjectRef, str] = {}
        self._names = (f"gen-{i}" for i in itertools.count())
        self._handle = None
        self.version = 0
        self.counters = {"sgs/duplicates": 0, "sgs/resubmitted": 0, "sgs/instances_added": 0,
                         "sgs/instances_removed": 0}

    # ------------------------------------------------------------------------------- instances
    def add_instance(self) -> str:
        g = self.cfg.generation
        name = next(self._names)
        actor = GenerationInstance.options(num_cpus=g.threads_per_instance, resources=dict(g.resources),
                                           name=None).remote(name, self.cfg.model_dump(), self.policy_path,
                                                             g.threads_per_instance, self.cfg.run.seed + len(self.instances))
        ray.get(actor.ready.remote())
        if self._handle is not None:
            ray.get(actor.update.remote(self._handle, self.version))
        self.instances[name] = actor
        self.counters["sgs/instances_added"] += 1
        return name

    def remove_instance(self, name: str) -> int:
        """Kill ``name`` and re-submit its unfinished requests elsewhere; returns how many moved."""
        if name not in self.instances:
            raise KeyError(f"no generation instance {name!r}; have {sorted(self.instances)}")
        if len(self.instances) == 1 and any(inst == name for inst, _ in self.assigned.values()):
            raise RuntimeError(f"cannot remove {name!r}: it is the last instance and has unfinished requests")
        actor = self.instances.pop(name)
        for ref in [r for r, n in self._polls.items() if n == name]:
            del self._polls[ref]
        ray.kill(actor)
        orphans = [req for inst, req in self.assigned.values() if inst == name]
        for req in orphans:
            del self.assigned[req.request_id]
        if orphans:
            self.submit(orphans)
            self.counters["sgs/resubmitted"] += len(orphans)
        self.counters["sgs/instances_removed"] += 1
        return len(orphans)

    # ---------------------------------------------------------------------------------- weights
    def update(self, handle, version: int, wait: bool = True):
        """Install ``version`` on every instance. ``wait=False`` returns the refs (overlap)."""
        self._handle, self.version = handle, version
        refs = [a.update.remote(handle, version) for a in self.instances.values()]
        return ray.get(refs) if wait else refs

    # ------------------------------------------------------------------------------- requests
    def submit(self, requests: list[GenRequest], predicted_lengths: list[float] | None = None) -> None:
        if not self.instances:
            raise RuntimeError("the SGS has no generation instance; call add_instance() first")
        for r in requests:
            if r.request_id in self.assigned or r.request_id in self.returned:
                raise ValueError(f"request {r.request_id!r} was already submitted")
        names = sorted(self.instances)
        lengths = predicted_lengths if predicted_lengths is not None else [r.priority for r in requests]
        choice = self.dispatch.assign(lengths, len(names))
        per_instance: dict[str, list[GenRequest]] = {}
        for r, k in zip(requests, choice):
            per_instance.setdefault(names[k], []).append(r)
            self.assigned[r.request_id] = (names[k], r)
        ray.get([self.instances[n].submit.remote(rs) for n, rs in per_instance.items()])

    def pending(self) -> int:
        return len(self.assigned)

    def poll(self, timeout: float = 1.0) -> list[Completion]:
        """Completions that finished since the last call (possibly none after ``timeout``)."""
        for name, actor in self.instances.items():
            if name not in self._polls.values():
                self._polls[actor.poll.remote(0.5)] = name
        if not self._polls:
            return []
        ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=timeout)
        out: list[Completion] = []
        for ref in ready:
            name = self._polls.pop(ref)
            try:
                batch = ray.get(ref)
            except ray.exceptions.RayActorError:
                log.warning("generation instance %s died; its requests are re-submitted", name)
                if name in self.instances:
                    self.remove_instance(name)
                continue
            for c in batch:
                if c.request_id not in self.assigned:
                    self.counters["sgs/duplicates"] += 1
                    continue
                del self.assigned[c.request_id]
                self.returned.add(c.request_id)
                out.append(c)
            if name in self.instances:
                self._polls[self.instances[name].poll.remote(0.5)] = name
        return out

    def generate(self, requests: list[GenRequest], predicted_lengths: list[float] | None = None) -> Iterator[Completion]:
        """Submit ``requests`` and yield each completion as it finishes (completion order)."""
        self.submit(requests, predicted_lengths)
        wanted = {r.request_id for r in requests}
        while wanted:
            for c in self.poll():
                wanted.discard(c.request_id)
                yield c

    # ------------------------------------------------------------------------------------ misc
    def stats(self) -> dict[str, dict]:
        return dict(zip(self.instances, ray.get([a.stats.remote() for a in self.instances.values()])))

    def drain_events(self) -> list[tuple]:
        return [e for evs in ray.get([a.drain_events.remote() for a in self.instances.values()]) for e in evs]

    def shutdown(self) -> None:
        for actor in self.instances.values():
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort at teardown; the actor is killed next
                pass
            ray.kill(actor)
        self.instances.clear()
        self._polls.clear()

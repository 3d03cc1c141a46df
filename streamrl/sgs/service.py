"""The Stream Generation Service (SGS): a pool of generation instances behind two calls.

    update(handle, version)   install policy version ``version`` on every instance
    submit(requests) / poll() (or generate(requests), an iterator): finished samples come back
                              from all instances in completion order, each as it finishes

Dataflow::

    controller --submit--> predicted lengths (ranker table lookup, or given)
                           --> dispatch policy (config: generation.dispatch) picks the instance
                           --> order policy (generation.order) sets each request's priority
                           --> instance k: engine queue (admits larger priority first: LPT)
    controller <--poll---- ray.wait over one outstanding ``poll`` per busy instance; a returned
                           batch is handed out and that poll re-armed; rebalancing check
    end of a ``generate`` batch: ranker recall/Spearman (``take_metrics``); lengths to the dispatch
                           policy (P50/P90) and to the ranker's background refresh (never waited on)

Predicted lengths: the given ones (``submit(requests, predicted_lengths)``: the scheduling bench's
oracle), else the ``OnlineRanker`` (dataset registered with ``attach_prompts``, scored ahead)
when dispatch, order or rebalancing needs them, else all equal.

Exactly once: every submitted request is recorded until its completion is handed out.
``remove_instance`` re-submits an instance's unfinished requests to the others; a completion for
a request already handed out (or never submitted) is dropped and counted (``sgs/duplicates``).
A new instance first installs the current weights, so it never generates with a stale version.

Rebalancing (beyond the paper, ``scheduling.rebalance``; docs/design.md): instances then hold
submitted requests in their own queue and give the engine only a batch plus a little slack
(``instance.py``). At most every ``generation.rebalance_interval_s``, and only while a check could
act (otherwise polls are plain: periodic progress calls take CPU from the instances), polls carry
``progress`` (held, queued, or running with n tokens) and ``remaining_estimate`` turns predictions
into remaining lengths. ``scheduling.rebalance.plan_round`` (the simulator runs it too) acts only
when some instance has free batch slots and the remaining times differ by more than
``generation.rebalance_threshold``, moving at most as many requests into an instance as it has
free slots (work stealing). The source ``preempt``s them: a not-started request moves as it is,
a running one (``generation.rebalance_running``, at most once) continues from ``prompt + prefix``
and its two parts are joined into one ``Completion``. Never lost, never run twice.

Faults: every call to an instance goes through ``_gather`` (or ``poll``). An instance whose
actor died, or that answers no call within ``generation.heartbeat_timeout_s`` (a poll returns
every 0.5 s when healthy), is killed and removed (``_fail``): its unfinished requests are
re-dispatched to the others from their start, or from their joined prefix if they had moved
(``sgs/faults``, ``sgs/requeued``), and with ``generation.restart`` a replacement is started
that installs the current weights before it takes work, within ``generation.max_restarts``.
With no instance left and none startable, ``GenerationFailed``; a weight update whose buffer's
owner (the trainer) is gone raises ``TrainerFailed``: the message names the side that failed.

Placement: each instance is a Ray actor with ``generation.threads_per_instance`` CPUs and
``generation.resources``, or on ``placement.device=cuda`` its bundle of the placement plan.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import replace
from typing import Iterator, Sequence

import ray

from streamrl.config import Config
from streamrl.errors import GenerationFailed, TrainerFailed
from streamrl.placement import PlacementPlan, gen_labels, plan_placement
from streamrl.scheduling.dispatch import make_dispatch_policy
from streamrl.scheduling.latency import H800_QWEN7B_VLLM, LatencyModel, load_profile
from streamrl.scheduling.order import make_order_policy
from streamrl.scheduling.rebalance import Unfinished, has_free_slots, plan_round
from streamrl.ranker.online import OnlineRanker, batch_rank_metrics, make_online_ranker, state_dict_of
from streamrl.sgs.instance import GenerationInstance
from streamrl.types import Completion, Event, GenRequest, Partial, Progress
from streamrl.weights.engine import tree_calls
from streamrl.weights.tree import Location, levels, plan_tree

log = logging.getLogger(__name__)

NEEDS_LENGTHS = ("skewness-aware", "skewness-search", "least-loaded")
RESUME_PRIORITY = 1e30  # a resumed request is admitted before everything queued at its new instance


class StreamGenerationService:
    def __init__(self, cfg: Config, policy_path: str | None = None, dispatch: str | None = None,
                 dispatch_kwargs: dict | None = None, ranker: OnlineRanker | None | str = "config",
                 engine_overrides: dict | None = None, hold_back: bool | None = None,
                 plan: PlacementPlan | None = None, fault_log: str | None = None) -> None:
        g = cfg.generation
        self.fault_log = fault_log  # a JSONL file each fault record is appended to as it happens
        self.cfg = cfg
        self.plan = plan  # the driver's placement plan; only GPU placement reads it
        self.policy_path = policy_path or cfg.policy.path
        self.latency: LatencyModel = load_profile(g.latency_profile) if g.latency_profile else H800_QWEN7B_VLLM
        self.dispatch_name = dispatch or g.dispatch
        self.dispatch = make_dispatch_policy(
            self.dispatch_name, **(dispatch_kwargs if dispatch_kwargs is not None else self._dispatch_kwargs(self.dispatch_name)))
        self.order = make_order_policy(g.order, g.order_head)
        self.rebalance = g.rebalance
        self.rebalance_threshold = g.rebalance_threshold
        self.rebalance_running = g.rebalance_running
        self.rebalance_interval_s = g.rebalance_interval_s
        self.engine_overrides = dict(engine_overrides or {})
        self.hold_back = g.rebalance if hold_back is None else hold_back  # instances keep queued requests movable
        wants_lengths = self.dispatch_name in NEEDS_LENGTHS or g.order != "fifo" or g.rebalance
        if ranker == "config":
            ranker = make_online_ranker(cfg) if wants_lengths else None
        self.ranker: OnlineRanker | None = ranker
        self.instances: dict[str, ray.actor.ActorHandle] = {}
        self.locations: dict[str, Location] = {}  # instance -> its node and site (the weight tree's input)
        self.assigned: dict[str, tuple[str, GenRequest]] = {}
        self.predicted: dict[str, float] = {}
        self.returned: set[str] = set()  # handed out, of the last few batches (a duplicate submit is refused)
        self._returned_batches: deque = deque(maxlen=4)
        self._polls: dict[ray.ObjectRef, str] = {}
        self._armed_at: dict[ray.ObjectRef, float] = {}  # poll ref -> perf_counter when sent (heartbeat)
        self.heartbeat_s = g.heartbeat_timeout_s
        self.faults: list[dict] = []  # one record per failed instance: name, reason, wall time, requeued
        self._early: list[Completion] = []  # polled while retiring an instance: handed out by the next poll
        self._retiring: set[str] = set()  # instances finishing their last requests: given no new work
        self._live: dict[str, tuple[int, float]] = {}  # instance -> (liveness counter, when it last changed)
        self._live_checked = time.perf_counter()
        self._names = (f"gen-{i}" for i in itertools.count())
        self._handle = None
        self.version = 0
        self._last_check = float("-inf")  # perf_counter of the last rebalancing check
        self._progress: dict[str, Progress] = {}  # instance -> its latest progress (from poll_with_progress)
        self._prefix: dict[str, Partial] = {}
        # request_id -> everything generated before its preemptions (the request as submitted, its
        # tokens, log-probs and their versions, earliest version_start, first t_start): joined to the continuation
        self._moved_running: set[str] = set()
        self._recent = deque(maxlen=2048)  # recent output lengths: remaining_estimate's overshoot
        self._metrics: dict[str, float] = {}
        self.counters = {"sgs/duplicates": 0, "sgs/resubmitted": 0, "sgs/instances_added": 0,
                         "sgs/instances_removed": 0, "sgs/rebalanced": 0, "sgs/rebalanced_running": 0,
                         "sgs/rebalance_rounds": 0, "sgs/faults": 0, "sgs/requeued": 0, "sgs/restarts": 0}

    def configure(self, dispatch: str, order: str, rebalance: bool, dispatch_kwargs: dict | None = None) -> None:
        """Switch the scheduling policies between batches (benchmarks compare them on one pool).

        Rebalancing needs instances that hold requests back (``hold_back``): it can only be
        switched on for a service built with it."""
        if rebalance and not self.hold_back:
            raise ValueError("rebalance=True needs instances built with hold_back=True (generation.rebalance "
                             "or StreamGenerationService(hold_back=True))")
        if self.assigned:
            raise RuntimeError(f"cannot change scheduling with {len(self.assigned)} requests in flight")
        self.dispatch_name = dispatch
        self.dispatch = make_dispatch_policy(dispatch, **(dispatch_kwargs if dispatch_kwargs is not None
                                                           else self._dispatch_kwargs(dispatch)))
        self.order = make_order_policy(order, self.cfg.generation.order_head)
        self.rebalance = rebalance
        self._last_check = float("-inf")

    def _dispatch_kwargs(self, name: str) -> dict:
        g = self.cfg.generation
        if name == "random":
            return {"seed": self.cfg.run.seed}
        if name == "skewness-aware":
            if g.latency_profile is None:
                log.warning("skewness-aware dispatch without generation.latency_profile: using the paper's H800 PTL table")
            return {"latency": self.latency, "alpha": g.skew_alpha, "max_batch_size": g.max_requests_per_batch}
        if name == "skewness-search":
            return {"latency": self.latency, "max_batch_size": g.max_requests_per_batch}
        return {}

    # ------------------------------------------------------------------------------- instances
    def _instance_options(self, index: int) -> dict:
        """Ray resources of the ``index``-th instance added: ``generation.threads_per_instance``
        CPUs and ``generation.resources`` on CPU; on ``placement.device=cuda`` the CPUs, GPUs and
        GPU-type label of the placement plan's bundle ``gen-<index>`` (an instance added beyond
        ``generation.num_instances`` asks for the last planned instance's bundle)."""
        g = self.cfg.generation
        if self.cfg.placement.device != "cuda":
            cpus = g.cpus_per_instance if g.cpus_per_instance is not None else g.threads_per_instance
            return {"num_cpus": cpus, "resources": {**g.resources, **gen_labels(self.cfg, index)}}
        if self.plan is None:
            self.plan = plan_placement(self.cfg)
        planned = self.plan.generation
        bundle = planned[min(index, len(planned) - 1)].resources
        labels = {k: v for k, v in bundle.items() if k not in ("CPU", "GPU")}
        return {"num_cpus": bundle["CPU"], "num_gpus": bundle["GPU"], "resources": {**labels, **g.resources}}

    def add_instance(self) -> str:
        """Start one instance (with the current weights) and return its name. One that dies while
        starting counts as a fault and is started again, within ``generation.max_restarts``."""
        g = self.cfg.generation
        while True:
            try:
                name = self._start_instance()
            except ray.exceptions.RayActorError as exc:
                self._new_fault("(starting)", f"died while starting ({type(exc).__name__})", 0)
                if not (g.restart and self.counters["sgs/restarts"] < g.max_restarts):
                    raise GenerationFailed(f"a generation instance died while starting ({type(exc).__name__}) and "
                                           f"no restart is left (generation.max_restarts={g.max_restarts})") from None
                self.counters["sgs/restarts"] += 1
                log.warning("a generation instance died while starting; starting another")
                continue
            for record in self.faults:  # the starts that died before this one are recovered now
                if record["instance"] == "(starting)" and record["replaced_at"] is None:
                    record["replacement"], record["replaced_at"] = name, time.time()
                    self._log_fault(record)
            return name

    def _start_instance(self) -> str:
        g = self.cfg.generation
        name = next(self._names)
        options = self._instance_options(self.counters["sgs/instances_added"])
        actor = GenerationInstance.options(**options, **self.cfg.cluster.actor_options(), name=None).remote(
            name, self.cfg, self.policy_path, g.threads_per_instance, self.cfg.run.seed + len(self.instances),
            hold_back=self.hold_back, engine_overrides=self.engine_overrides)
        try:
            ray.get(actor.ready.remote(), timeout=g.replacement_timeout_s)
            self.locations[name] = ray.get(actor.location.remote(), timeout=g.replacement_timeout_s)
            if self._handle is not None:  # the current weights before any work
                ray.get(actor.update.remote(self._handle, self.version), timeout=max(self.heartbeat_s, g.replacement_timeout_s))
        except ray.exceptions.GetTimeoutError:
            ray.kill(actor)
            raise GenerationFailed(
                f"generation instance {name} did not start within generation.replacement_timeout_s="
                f"{g.replacement_timeout_s:g}s (Ray resources free now: {ray.available_resources()})") from None
        except ray.exceptions.ObjectLostError as exc:
            ray.kill(actor)
            raise TrainerFailed(f"weights version {self.version} are lost (the trainer that published them "
                                f"died): {type(exc).__name__}") from None
        self.instances[name] = actor
        self.counters["sgs/instances_added"] += 1
        return name

    def retire_instance(self, name: str) -> int:
        """Scale down by one, losing no work: ``name``'s unfinished requests are stopped there
        (queued ones as they are, running ones with their prefix, as rebalancing does) and
        dispatched to the others, then it shuts down. Returns how many requests moved."""
        if name not in self.instances:
            raise KeyError(f"no generation instance {name!r}; have {sorted(self.instances)}")
        if len(self.instances) == 1:
            raise RuntimeError(f"cannot retire {name!r}: it is the last instance")
        mine = [rid for rid, (inst, _) in self.assigned.items() if inst == name]
        parts = self._gather({name: self.instances[name].preempt.remote(mine, True)}, "preempt").get(name, [])
        if name not in self.instances:  # it failed while being retired: _fail re-dispatched its requests
            return len(mine)
        moved = [self._continuation(p) for p in parts]
        for req in moved:
            self.assigned.pop(req.request_id, None)
        self._retiring.add(name)  # no dispatch or rebalancing sends it anything from here on
        try:
            self._redispatch(moved)
            # What it did not stop (finishing now) comes back through its polls, those in flight
            # included (dropping them would lose the completions they carry): wait for those.
            while name in self.instances and any(inst == name for inst, _ in self.assigned.values()):
                self._early.extend(self._poll(timeout=1.0))  # not poll(): that would hand _early back
        finally:
            self._retiring.discard(name)
        if name in self.instances:  # else it failed meanwhile: _fail re-dispatched the rest
            actor = self._detach(name)
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - it is going away either way
                pass
            ray.kill(actor)
        self.counters["sgs/instances_removed"] += 1
        return len(moved)

    def _detach(self, name: str):
        """Forget instance ``name`` (its polls and progress too) and return its actor handle."""
        actor = self.instances.pop(name)
        self._progress.pop(name, None)
        self.locations.pop(name, None)
        for ref in [r for r, n in self._polls.items() if n == name]:
            del self._polls[ref]
            self._armed_at.pop(ref, None)
        return actor

    def _take_unfinished(self, name: str) -> list[GenRequest]:
        """Unassign and return the requests ``name`` has not finished (to send elsewhere)."""
        reqs = [req for inst, req in self.assigned.values() if inst == name]
        for req in reqs:
            del self.assigned[req.request_id]
        return reqs

    def _redispatch(self, requests: list[GenRequest]) -> None:
        """Send requests taken off an instance through dispatch again, with their predictions."""
        if requests:
            self._dispatch_and_send(requests, [self.predicted.get(r.request_id, 1.0) for r in requests])

    def remove_instance(self, name: str) -> int:
        """Kill ``name`` and re-submit its unfinished requests elsewhere; returns how many moved."""
        if name not in self.instances:
            raise KeyError(f"no generation instance {name!r}; have {sorted(self.instances)}")
        if len(self.instances) == 1 and any(inst == name for inst, _ in self.assigned.values()):
            raise RuntimeError(f"cannot remove {name!r}: it is the last instance and has unfinished requests")
        ray.kill(self._detach(name))
        orphans = self._take_unfinished(name)
        self._redispatch(orphans)
        self.counters["sgs/resubmitted"] += len(orphans)
        self.counters["sgs/instances_removed"] += 1
        return len(orphans)

    # ----------------------------------------------------------------------------------- faults
    def _gather(self, refs: dict[str, ray.ObjectRef], what: str) -> dict[str, object]:
        """The results of one call per instance (``{name: ref}``); an instance that died or did
        not answer within the heartbeat timeout is failed over (``_fail``) and left out."""
        out: dict[str, object] = {}
        deadline = time.perf_counter() + self.heartbeat_s
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
            import json

            with open(self.fault_log, "a") as f:
                f.write(json.dumps(record) + "\n")

    def _check_progress(self, now: float) -> None:
        """Fail over an instance that has unfinished requests but has generated no token for the
        heartbeat timeout while still answering (its engine stopped stepping). Read every quarter
        of the timeout, only from instances with work."""
        self._live_checked = now
        busy = {n for n, c in self._unfinished_counts().items() if c}
        for name in [n for n in self._live if n not in busy]:
            del self._live[name]  # idle: its clock starts again when it gets work
        values = self._gather({n: self.instances[n].liveness.remote() for n in busy if n in self.instances}, "liveness")
        for name, value in values.items():
            seen = self._live.get(name)
            if seen is None or seen[0] != value:
                self._live[name] = (value, now)
            elif now - seen[1] > self.heartbeat_s:
                del self._live[name]
                self._fail(name, f"generated no token for {now - seen[1]:.0f}s with work queued "
                                 f"(generation.heartbeat_timeout_s={self.heartbeat_s:g}s)")

    def _fail(self, name: str, reason: str) -> None:
        """Remove a dead or hung instance, start a replacement if allowed, and re-dispatch its
        unfinished requests (nothing is lost; each still completes exactly once)."""
        if name not in self.instances:
            return
        log.warning("generation instance %s %s: removed, its unfinished requests re-dispatched", name, reason)
        try:
            ray.kill(self._detach(name))  # a hung process is stopped for good; a dead one is already gone
        except Exception:  # noqa: BLE001 - the actor may be unknown to Ray by now
            pass
        orphans = self._take_unfinished(name)
        record = self._new_fault(name, reason, len(orphans))
        g = self.cfg.generation
        if name in self._retiring:  # it was going away: nothing to replace
            pass
        elif g.restart and self.counters["sgs/restarts"] < g.max_restarts:
            self.counters["sgs/restarts"] += 1
            try:
                log.warning("starting a replacement for %s (%d of generation.max_restarts=%d)", name,
                            self.counters["sgs/restarts"], g.max_restarts)
                record["replacement"] = self.add_instance()
                record["replaced_at"] = time.time()
                self._log_fault(record)  # again, now with its replacement
            except GenerationFailed as exc:
                if not self.instances:
                    raise
                log.warning("no replacement for %s: %s", name, exc)
        if not self.instances:
            raise GenerationFailed(
                f"every generation instance is gone (the last, {name}, {reason}); "
                + (f"generation.max_restarts={g.max_restarts} replacements used" if g.restart
                   else "generation.restart is false") + f"; {len(orphans)} requests were unfinished")
        self._redispatch(orphans)
        self.counters["sgs/requeued"] += len(orphans)

    # ---------------------------------------------------------------------------------- weights
    def update(self, handle, version: int, wait: bool = True):
        """Install ``version`` on every instance, along the weight tree (``weights.method``: every
        instance from the trainer, or one copy per node and per remote site through relays).
        ``wait=False`` returns the refs (overlap)."""
        self._handle, self.version = handle, version
        parents = self.weight_tree(handle)
        refs = tree_calls(handle, parents, lambda n, src, relay: self.instances[n].update.remote(src, version, relay))
        if self.ranker is not None:  # rankers that score with the policy fetch it in their thread
            self.ranker.set_policy(lambda: state_dict_of(handle), version)
        if not wait:
            return list(refs.values())
        # A replacement started while failing over installs self._handle itself (add_instance).
        return self._gather_tree(refs, parents, handle, version)

    def weight_tree(self, handle) -> dict[str, str | None]:
        """Each instance's parent in this update's broadcast tree (``weights.tree.plan_tree``)."""
        w = self.cfg.weights
        source = Location(handle.origin_node, handle.origin_site)
        return plan_tree(source, {n: self.locations.get(n, Location(n)) for n in self.instances}, w.method, w.fanout)

    def _gather_tree(self, refs: dict, parents: dict[str, str | None], handle, version: int) -> list[dict]:
        """Each instance's update result, parents first; an instance whose relay failed (and was
        failed over) fetches from the trainer instead, so one dead relay costs no other instance."""
        failed: set[str] = set()
        out = []
        for level in levels(parents):
            for name in level:
                if name not in self.instances:
                    failed.add(name)
                    continue
                ref = refs[name]
                if parents[name] in failed:
                    ref = self.instances[name].update.remote(handle, version, False)
                got = self._gather({name: ref}, f"weight update to version {version}")
                if name in got:
                    out.append(got[name])
                else:
                    failed.add(name)
        return out

    # ---------------------------------------------------------------------------------- ranker
    def attach_prompts(self, prompts: Sequence) -> None:
        """Register the dataset's prompts (``prompt_id``, ``text``) so the ranker scores them ahead."""
        if self.ranker is not None:
            self.ranker.register([p.prompt_id for p in prompts], [p.text for p in prompts])

    def prefetch(self, prompts: Sequence) -> None:
        """Let the ranker score the next batch's prompts ahead (rankers that score with the policy)."""
        if self.ranker is not None:
            self.ranker.prefetch([p.prompt_id for p in prompts])

    def predict(self, requests: Sequence[GenRequest]) -> list[float]:
        """Predicted output length per request: the ranker's table, else all equal (1.0)."""
        if self.ranker is None:
            return [1.0] * len(requests)
        return self.ranker.predict([r.prompt_id for r in requests]).tolist()

    # ------------------------------------------------------------------------------- requests
    def submit(self, requests: list[GenRequest], predicted_lengths: Sequence[float] | None = None,
               priority_offset: float = 0.0) -> None:
        """Dispatch ``requests``; ``priority_offset`` is added to the order policy's priorities (a
        batch admitted ahead of its iteration goes behind every request of the current one)."""
        if not self.instances:
            raise RuntimeError("the SGS has no generation instance; call add_instance() first")
        seen: set[str] = set()
        for r in requests:
            if r.request_id in self.assigned or r.request_id in self.returned or r.request_id in seen:
                raise ValueError(f"request {r.request_id!r} was already submitted")
            seen.add(r.request_id)
        if predicted_lengths is None:
            lengths = self.predict(requests)
        else:
            lengths = [float(x) for x in predicted_lengths]
            if len(lengths) != len(requests):
                raise ValueError(f"{len(lengths)} predicted lengths for {len(requests)} requests")
            bad = [x for x in lengths if not x >= 0]
            if bad:
                raise ValueError(f"predicted lengths must be >= 0, got {bad[:5]}")
        self._dispatch_and_send(requests, lengths, priority_offset)
        if self.rebalance:
            self._maybe_rebalance()

    def _dispatch_and_send(self, requests: list[GenRequest], lengths: list[float], priority_offset: float = 0.0) -> None:
        names = sorted(n for n in self.instances if n not in self._retiring)
        choice = self.dispatch.assign(lengths, len(names))
        priorities = self.order.priorities(lengths)
        per_instance: dict[str, list[GenRequest]] = {}
        for r, k, length, prio in zip(requests, choice, lengths, priorities):
            r = replace(r, priority=prio + priority_offset)
            per_instance.setdefault(names[k], []).append(r)
            self.assigned[r.request_id] = (names[k], r)
            self.predicted[r.request_id] = length
        self._gather({n: self.instances[n].submit.remote(rs) for n, rs in per_instance.items()}, "submit")

    def pending(self) -> int:
        return len(self.assigned)

    def poll(self, timeout: float = 1.0) -> list[Completion]:
        """Completions that finished since the last call (possibly none after ``timeout``)."""
        if self._early:
            out, self._early = self._early, []
            return out
        return self._poll(timeout)

    def _poll(self, timeout: float) -> list[Completion]:
        counts = self._unfinished_counts()
        # Progress is read only while a rebalancing check could act (some instance has free slots:
        # plan_round returns nothing otherwise); until then a plain poll, and no 0.1 s wake-ups.
        want_progress = self.rebalance and has_free_slots(counts, self.cfg.generation.max_requests_per_batch)
        armed = set(self._polls.values())
        for name, actor in self.instances.items():
            if counts.get(name) and name not in armed:  # an idle instance's poll would return at once: a spin
                ref = (actor.poll_with_progress.remote(min(0.5, self.rebalance_interval_s)) if want_progress
                       else actor.poll.remote(0.5))
                self._polls[ref] = name
                self._armed_at[ref] = time.perf_counter()
        if not self._polls:
            return []
        ready, _ = ray.wait(list(self._polls), num_returns=1, timeout=timeout)
        now = time.perf_counter()
        for ref in [r for r in self._polls if r not in ready and now - self._armed_at.get(r, now) > self.heartbeat_s]:
            if ref in self._polls:  # a poll of 0.5 s that has not returned for the heartbeat timeout: hung
                self._fail(self._polls[ref], f"answered no poll within generation.heartbeat_timeout_s={self.heartbeat_s:g}s")
        if now - self._live_checked >= self.heartbeat_s / 4:
            self._check_progress(now)
        out: list[Completion] = []
        for ref in ready:
            if ref not in self._polls:  # its instance was failed over just above
                continue
            name = self._polls.pop(ref)
            self._armed_at.pop(ref, None)
            try:
                batch = ray.get(ref)
                if isinstance(batch, tuple):  # poll_with_progress
                    batch, self._progress[name] = batch
                else:  # a plain poll: the last progress of this instance is stale now
                    self._progress.pop(name, None)
            except ray.exceptions.RayActorError as exc:
                self._fail(name, f"died ({type(exc).__name__}) during poll")
                continue
            for c in batch:
                if c.request_id not in self.assigned:
                    self.counters["sgs/duplicates"] += 1
                    continue
                del self.assigned[c.request_id]
                self.returned.add(c.request_id)
                if c.request_id in self._prefix:
                    c = self._join(c)
                self._recent.append(len(c.output_ids))
                out.append(c)
        if self.rebalance and self.assigned:
            self._maybe_rebalance()
        return out

    def _join(self, c: Completion) -> Completion:
        """One Completion from a preempted request's prefix and its continuation's output."""
        pre = self._prefix.pop(c.request_id)
        return replace(c, prompt_ids=tuple(pre.request.prompt_ids), output_ids=pre.output_ids + c.output_ids,
                       logprobs=pre.logprobs + c.logprobs, version_start=min(pre.version_start, c.version_start),
                       t_start=pre.t_start, token_versions=pre.versions() + c.versions())

    def generate(self, requests: list[GenRequest], predicted_lengths: Sequence[float] | None = None) -> Iterator[Completion]:
        """Submit ``requests`` and yield each completion as it finishes (completion order).

        After the last one: per-batch metrics (``take_metrics``) and the ranker/dispatch refresh."""
        self.submit(requests, predicted_lengths)
        predicted = {r.request_id: self.predicted[r.request_id] for r in requests}
        wanted = set(predicted)
        done: list[Completion] = []
        while wanted:
            for c in self.poll():
                wanted.discard(c.request_id)
                done.append(c)
                yield c
        self._end_batch(requests, predicted, done, given=predicted_lengths is not None)

    def finish_batch(self, requests: list[GenRequest], predicted: dict[str, float], done: list[Completion]) -> None:
        """What ``generate`` does after a batch's last completion, for a caller that submitted and
        polled itself (``predicted``: ``self.predicted`` of each request, read at submission)."""
        self._end_batch(requests, predicted, done, given=False)

    def _end_batch(self, requests: list[GenRequest], predicted: dict[str, float], done: list[Completion],
                   given: bool) -> None:
        """Log the batch's ranking quality; feed its lengths to dispatch and (background) ranker."""
        self._returned_batches.append([c.request_id for c in done])  # bounded: 4 batches are remembered
        if len(self._returned_batches) == self._returned_batches.maxlen:
            self.returned.difference_update(self._returned_batches[0])
        lengths = {c.request_id: len(c.output_ids) for c in done}
        ids = [r.request_id for r in requests]
        actual = [float(lengths[i]) for i in ids]
        for i in ids:
            self.predicted.pop(i, None)
            self._moved_running.discard(i)
        if self.ranker is not None or given:
            self._metrics.update(batch_rank_metrics([predicted[i] for i in ids], actual))
            # Per prompt too (GRPO's dispatch unit): truth is the group's mean length.
            groups: dict[str, list[float]] = {}
            group_pred: dict[str, float] = {}  # one prediction per prompt (a table lookup by prompt)
            for r, n in zip(requests, actual):
                groups.setdefault(r.prompt_id, []).append(n)
                group_pred.setdefault(r.prompt_id, predicted[r.request_id])
            if len(groups) < len(requests):
                self._metrics.update(batch_rank_metrics([group_pred[k] for k in groups],
                                                        [sum(v) / len(v) for v in groups.values()], prefix="rank/group/"))
        self.dispatch.observe(actual)
        if self.ranker is not None:
            traces = None
            if self.ranker.ranker.uses_traces:
                from streamrl.ranker.reweighted import Trace

                by_id = {c.request_id: c for c in done}
                # A completion without a log-prob per token (an engine not asked for them) has no
                # behaviour probability to weigh against: its length counts unweighted.
                traces = [Trace(tuple(c.output_ids), float(sum(c.logprobs)), tuple(c.logprobs))
                          if len(c.logprobs) == len(c.output_ids) else None for c in (by_id[i] for i in ids)]
            self.ranker.observe([r.prompt_id for r in requests], actual, traces)
            self._metrics.update(self.ranker.metrics())

    def take_metrics(self) -> dict[str, float]:
        """Metrics since the last call: ranking quality of the last batch; the live instance count
        and the run's rebalancing and fault counters (cumulative)."""
        out = {**self._metrics, "sgs/instances": float(len(self.instances)),
               **{k: float(self.counters[k]) for k in ("sgs/rebalanced", "sgs/faults", "sgs/requeued",
                                                       "sgs/restarts", "sgs/resubmitted", "sgs/duplicates")}}
        self._metrics = {}
        return out

    # ------------------------------------------------------------------------------ rebalance
    def _maybe_rebalance(self) -> int:
        """Move requests off an instance whose predicted remaining time is far above another's
        while some instance has free slots (module docstring); returns how many moved."""
        now = time.perf_counter()
        if len(self.instances) < 2 or now - self._last_check < self.rebalance_interval_s:
            return 0
        self._last_check = now
        cap = self.cfg.generation.max_requests_per_batch
        counts = {n: c for n, c in self._unfinished_counts().items() if n not in self._retiring}
        if len(counts) < 2 or not has_free_slots(counts, cap):
            return 0  # every instance has a full batch of work, or there is nothing to split: no Ray call
        missing = [n for n in counts if n not in self._progress]  # not polled yet since it got work
        self._progress.update(self._gather({n: self.instances[n].progress.remote() for n in missing}, "progress"))
        names = [n for n in counts if n in self.instances]  # without any instance failed over just now
        if len(names) < 2:
            return 0
        moves = plan_round(self._unfinished({n: self._progress[n] for n in names}), self.latency, cap,
                           self.rebalance_threshold, sorted(self._recent))
        return self._apply_moves(moves) if moves else 0

    def _unfinished_counts(self) -> dict[str, int]:
        """Unfinished (assigned, not yet returned) requests per instance, 0 for an idle one."""
        counts = {n: 0 for n in self.instances}
        for name, _ in self.assigned.values():
            counts[name] = counts.get(name, 0) + 1
        return counts

    def _unfinished(self, states: dict[str, Progress]) -> dict[str, list[Unfinished]]:
        """Per instance, its unfinished requests as ``plan_round`` reads them: progress from the
        instances' states; movable if not started (held here, or queued in an engine that preempts),
        or running on an engine that preempts, with ``rebalance_running``, and not moved before."""
        out: dict[str, list[Unfinished]] = {name: [] for name in states}
        sets = {n: (set(st.held), set(st.waiting), st.running, st.preempt) for n, st in states.items()}
        for rid, (name, req) in self.assigned.items():
            if name not in sets:  # an instance being retired: its last requests stay where they are
                continue
            held, waiting, running, can_preempt = sets[name]
            prefix = self._prefix.get(rid)
            generated = (len(prefix.output_ids) if prefix else 0) + running.get(rid, 0)
            started = rid in running
            may_move = (rid in held or (rid in waiting and can_preempt)
                        or (started and can_preempt and self.rebalance_running and rid not in self._moved_running))
            out[name].append(Unfinished(rid, self.predicted.get(rid, 1.0), generated,
                                        (prefix.request if prefix else req).max_new_tokens, started, may_move))
        return out

    def _apply_moves(self, moves) -> int:
        """Preempt each move's request at its source and re-submit it (or its continuation) at its destination."""
        dst_of = {m.request_id: m.dst for m in moves}
        by_src: dict[str, list[str]] = {}
        for m in moves:
            by_src.setdefault(m.src, []).append(m.request_id)
        stopped = self._gather({src: self.instances[src].preempt.remote(ids, self.rebalance_running)
                                for src, ids in by_src.items() if src in self.instances}, "preempt")
        per_dst: dict[str, list[GenRequest]] = {}
        for parts in stopped.values():
            for part in parts:  # only requests the source stopped: none can also finish there
                per_dst.setdefault(dst_of[part.request.request_id], []).append(self._continuation(part))
        moved, lost_dst = 0, []
        for dst, reqs in per_dst.items():
            if dst not in self.instances:  # failed over meanwhile: these go through dispatch instead
                lost_dst += reqs
                continue
            for req in reqs:
                self.assigned[req.request_id] = (dst, req)
            moved += len(reqs)
        self._gather({dst: self.instances[dst].submit.remote(reqs) for dst, reqs in per_dst.items()
                      if dst in self.instances}, "submit")
        for req in lost_dst:
            self.assigned.pop(req.request_id, None)
        self._redispatch(lost_dst)
        self.counters["sgs/rebalanced"] += moved
        self.counters["sgs/rebalance_rounds"] += 1
        return moved

    def _continuation(self, part: Partial) -> GenRequest:
        """The request to send on for a preempted ``part``: itself if it had not started, else
        the prompt plus everything generated so far, with the rest of the token budget."""
        if not part.output_ids:
            return part.request
        rid = part.request.request_id
        prev = self._prefix.get(rid)
        if prev is not None:  # preempted before: the earlier prefix comes first
            part = Partial(prev.request, prev.output_ids + tuple(part.output_ids), prev.logprobs + tuple(part.logprobs),
                           min(prev.version_start, part.version_start), prev.t_start, prev.versions() + part.versions())
        self._prefix[rid] = part
        req, tokens = part.request, part.output_ids
        self._moved_running.add(rid)
        self.counters["sgs/rebalanced_running"] += 1
        return replace(req, prompt_ids=tuple(req.prompt_ids) + tokens, max_new_tokens=req.max_new_tokens - len(tokens),
                       priority=RESUME_PRIORITY)

    # ------------------------------------------------------------------------------------ misc
    def stats(self) -> dict[str, dict]:
        return self._gather({n: a.stats.remote() for n, a in self.instances.items()}, "stats")

    def drain_events(self) -> list[Event]:
        evs = self._gather({n: a.drain_events.remote() for n, a in self.instances.items()}, "drain_events")
        return [e for batch in evs.values() for e in batch]

    def shutdown(self) -> None:
        for actor in self.instances.values():
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort at teardown; the actor is killed next
                pass
            ray.kill(actor)
        self.instances.clear()
        self._polls.clear()
        if self.ranker is not None:
            self.ranker.close()

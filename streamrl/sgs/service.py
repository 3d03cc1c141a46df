"""The Stream Generation Service (SGS): a pool of generation instances behind two calls.

    update(handle, version)   install policy version ``version`` on every instance (weight tree)
    submit(requests) / poll() (or generate(requests), an iterator): finished samples come back
                              from all instances in completion order, each as it finishes

Submit: predicted lengths (given, or the online ranker's) -> dispatch rule picks the instance ->
order rule sets each request's priority -> the instance's engine queue. Poll: ``ray.wait`` over
one outstanding ``poll`` per busy instance; every finished one is handed out and re-armed.
Invariants: every request lives in the ``Ledger`` (``sgs/ledger.py``) from submit until its
completion is handed out, exactly once; a new instance installs the current weights before it
takes work. Faults: ``sgs/faults.py``; rebalancing: ``sgs/rebalancing.py``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from dataclasses import dataclass, replace
from typing import Iterator, Sequence

import ray

from streamrl.config import Config
from streamrl.errors import GenerationFailed, TrainerFailed
from streamrl.placement import PlacementPlan, gen_labels, plan_placement
from streamrl.ranker.online import OnlineRanker, batch_rank_metrics, make_online_ranker, state_dict_of
from streamrl.scheduling.dispatch import make_dispatch_policy
from streamrl.scheduling.latency import H800_QWEN7B_VLLM, LatencyModel, load_profile
from streamrl.scheduling.order import make_order_policy
from streamrl.scheduling.rebalance import has_free_slots
from streamrl.sgs.faults import FaultTolerance
from streamrl.sgs.instance import GenerationInstance
from streamrl.sgs.ledger import Ledger
from streamrl.sgs.rebalancing import Rebalancing
from streamrl.sgs.trajectories import Trajectories
from streamrl.types import Completion, Event, GenRequest, Progress
from streamrl.weights.engine import tree_calls
from streamrl.weights.tree import Location, plan_tree

log = logging.getLogger(__name__)

NEEDS_LENGTHS = ("skewness-aware", "skewness-search", "least-loaded")
POLL_S = 0.5  # a healthy instance's poll returns within this; one silent a heartbeat longer is hung


@dataclass
class Instance:
    """One generation instance as the SGS tracks it."""

    actor: ray.actor.ActorHandle
    location: Location  # its node and site (the weight tree's input)
    poll: ray.ObjectRef | None = None  # the outstanding poll, if any
    poll_due: float = 0.0  # perf_counter by which a healthy instance's ``poll`` returns (it blocks up to then)
    progress: Progress | None = None  # its latest progress (rebalancing reads it); None = stale
    live: tuple[int, float] | None = None  # (liveness counter, when it last changed) while it has work
    retiring: bool = False  # finishing its last requests: given no new work


class StreamGenerationService(FaultTolerance, Rebalancing, Trajectories):
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
        self.pool: dict[str, Instance] = {}
        self.ledger = Ledger()
        self.heartbeat_s = g.heartbeat_timeout_s
        self.faults: list[dict] = []  # one record per failed instance: name, reason, wall time, requeued
        self._early: list[Completion] = []  # polled while retiring an instance: handed out by the next poll
        self.agent = None  # an ``agent.loop.AgentLoop``: requests it owns are multi-turn trajectories
        self._live_checked = time.perf_counter()
        self._names = (f"gen-{i}" for i in itertools.count())
        self._handle = None
        self.version = 0
        self._last_check = float("-inf")  # perf_counter of the last rebalancing check
        self._recent = deque(maxlen=2048)  # recent output lengths: remaining_estimate's overshoot
        self._metrics: dict[str, float] = {}
        self.counters = {"sgs/duplicates": 0, "sgs/resubmitted": 0, "sgs/instances_added": 0,
                         "sgs/instances_removed": 0, "sgs/rebalanced": 0, "sgs/rebalanced_running": 0,
                         "sgs/rebalance_rounds": 0, "sgs/faults": 0, "sgs/requeued": 0, "sgs/restarts": 0,
                         "sgs/relay_fallbacks": 0}

    @property
    def instances(self) -> dict[str, ray.actor.ActorHandle]:
        """Each live instance's actor handle, by name."""
        return {name: inst.actor for name, inst in self.pool.items()}

    @property
    def locations(self) -> dict[str, Location]:
        return {name: inst.location for name, inst in self.pool.items()}

    def capacity(self) -> int:
        """Requests the pool runs at once: instances x ``generation.max_requests_per_batch``."""
        return len(self.pool) * self.cfg.generation.max_requests_per_batch

    def configure(self, dispatch: str, order: str, rebalance: bool, dispatch_kwargs: dict | None = None) -> None:
        """Switch the scheduling rules between batches (benchmarks compare them on one pool).

        Rebalancing needs instances that hold requests back (``hold_back``): it can only be
        switched on for a service built with it."""
        if rebalance and not self.hold_back:
            raise ValueError("rebalance=True needs instances built with hold_back=True (generation.rebalance "
                             "or StreamGenerationService(hold_back=True))")
        if self.ledger.pending():
            raise RuntimeError(f"cannot change scheduling with {self.ledger.pending()} requests in flight")
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
    def instance_options(self, index: int) -> dict:
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

    def room_for_instance(self) -> bool:
        """Whether Ray could place one more instance now (an add must never wait on resources
        that are not there: the run would stall for ``generation.replacement_timeout_s``)."""
        need = self.instance_options(self.counters["sgs/instances_added"])
        free = ray.available_resources()
        wants = {"CPU": need.get("num_cpus", 0), "GPU": need.get("num_gpus", 0), **need.get("resources", {})}
        return all(free.get(k, 0.0) + 1e-9 >= v for k, v in wants.items() if v)

    def add_instance(self) -> str:
        """Start one instance (with the current weights) and return its name."""
        return self.add_instances(1)[0]

    def add_instances(self, n: int) -> list[str]:
        """Start ``n`` instances at once (their processes load side by side), each installing the
        current weights before it takes work; returns their names. One that dies while starting
        counts as a fault and is started again, within ``generation.max_restarts``."""
        g = self.cfg.generation
        base = self.counters["sgs/instances_added"]
        starting = [self._launch(base + k, len(self.pool) + k) for k in range(n)]
        names = []
        while starting:
            name, actor, index, seed_offset = starting.pop(0)
            try:
                self._await_start(name, actor)
            except ray.exceptions.RayActorError as exc:
                self._new_fault("(starting)", f"died while starting ({type(exc).__name__})", 0)
                if not (g.restart and self.counters["sgs/restarts"] < g.max_restarts):
                    self._kill_starting(starting)
                    raise GenerationFailed(f"a generation instance died while starting ({type(exc).__name__}) and "
                                           f"no restart is left (generation.max_restarts={g.max_restarts})") from None
                self.counters["sgs/restarts"] += 1
                log.warning("a generation instance died while starting; starting another")
                starting.append(self._launch(index, seed_offset))  # the same bundle and seed as the one lost
                continue
            except (GenerationFailed, TrainerFailed):
                self._kill_starting(starting)
                raise
            names.append(name)
            for record in self.faults:  # the starts that died before this one are recovered now
                if record["instance"] == "(starting)" and record["replaced_at"] is None:
                    record["replacement"], record["replaced_at"] = name, time.time()
                    self._log_fault(record)
        return names

    def _launch(self, index: int, seed_offset: int) -> tuple:
        """Create the actor of the ``index``-th instance added (its Ray resources) without waiting."""
        g = self.cfg.generation
        name = next(self._names)
        actor = GenerationInstance.options(**self.instance_options(index), **self.cfg.cluster.actor_options(),
                                           name=None).remote(
            name, self.cfg, self.policy_path, g.threads_per_instance, self.cfg.run.seed + seed_offset,
            hold_back=self.hold_back, engine_overrides=self.engine_overrides)
        return name, actor, index, seed_offset

    @staticmethod
    def _kill_starting(starting: list) -> None:
        for _, actor, _, _ in starting:
            ray.kill(actor)

    def _await_start(self, name: str, actor) -> None:
        """Wait for a launched instance to load, then give it the current weights; it joins the pool."""
        g = self.cfg.generation
        try:
            ray.get(actor.ready.remote(), timeout=g.replacement_timeout_s)
            location = ray.get(actor.location.remote(), timeout=g.replacement_timeout_s)
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
        self.pool[name] = Instance(actor, location)
        self.counters["sgs/instances_added"] += 1

    def retire_instance(self, name: str) -> int:
        """Scale down by one, losing no work: ``name``'s unfinished requests are stopped there
        (queued ones as they are, running ones with their prefix, as rebalancing does) and
        dispatched to the others, then it shuts down. Returns how many requests moved."""
        if name not in self.pool:
            raise KeyError(f"no generation instance {name!r}; have {sorted(self.pool)}")
        if len(self.pool) == 1:
            raise RuntimeError(f"cannot retire {name!r}: it is the last instance")
        mine = [r.request.request_id for r in self.ledger.on(name)]
        parts = self._gather({name: self.pool[name].actor.preempt.remote(mine, True)}, "preempt").get(name, [])
        if name not in self.pool:  # it failed while being retired: _fail re-dispatched its requests
            return len(mine)
        moved = [self._continuation(p) for p in parts]
        self.pool[name].retiring = True  # no dispatch or rebalancing sends it anything from here on
        self._redispatch(moved)
        # What it did not stop (finishing now) comes back through its polls, the one in flight
        # included (dropping it would lose the completions it carries): wait for those.
        while name in self.pool and self.ledger.on(name):
            self._early.extend(self._poll(timeout=1.0))  # not poll(): that would hand _early back
        if name in self.pool:  # else it failed meanwhile: _fail re-dispatched the rest
            actor = self._detach(name)
            try:
                ray.get(actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - it is going away either way
                pass
            ray.kill(actor)
        self.counters["sgs/instances_removed"] += 1
        return len(moved)

    def _detach(self, name: str):
        """Forget instance ``name`` (its poll and progress too) and return its actor handle."""
        return self.pool.pop(name).actor

    def _redispatch(self, requests: list[GenRequest]) -> None:
        """Send requests taken off an instance through dispatch again, with their predictions."""
        if requests:
            self._dispatch_and_send(requests, [self.ledger.predicted(r.request_id) for r in requests])

    def remove_instance(self, name: str) -> int:
        """Kill ``name`` and re-submit its unfinished requests elsewhere; returns how many moved."""
        if name not in self.pool:
            raise KeyError(f"no generation instance {name!r}; have {sorted(self.pool)}")
        if len(self.pool) == 1 and self.ledger.on(name):
            raise RuntimeError(f"cannot remove {name!r}: it is the last instance and has unfinished requests")
        ray.kill(self._detach(name))
        orphans = self.ledger.take_from(name)
        self._redispatch(orphans)
        self.counters["sgs/resubmitted"] += len(orphans)
        self.counters["sgs/instances_removed"] += 1
        return len(orphans)

    # ---------------------------------------------------------------------------------- weights
    def update(self, handle, version: int, wait: bool = True):
        """Install ``version`` on every instance, along the weight tree (``weights.method``: every
        instance from the trainer, or one copy per node and per remote site through relays).
        ``wait=False`` returns the refs (overlap)."""
        self._handle, self.version = handle, version
        parents = self.weight_tree(handle)
        refs = tree_calls(handle, parents, lambda n, src, relay: self.pool[n].actor.update.remote(src, version, relay))
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
        return plan_tree(source, {n: inst.location for n, inst in self.pool.items()}, w.method, w.fanout)

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
               priority_offset: float = 0.0) -> list[float]:
        """Dispatch ``requests``; ``priority_offset`` is added to the order rule's priorities (a
        batch admitted ahead of its iteration goes behind every request of the current one).
        Returns the predicted length of each request (what dispatch used)."""
        if not self.pool:
            raise RuntimeError("the SGS has no generation instance; call add_instance() first")
        seen: set[str] = set()
        for r in requests:
            if self.ledger.known(r.request_id) or r.request_id in seen:
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
        for r, length in zip(requests, lengths):
            self.ledger.add(r, length)
        self._dispatch_and_send(requests, lengths, priority_offset)
        if self.rebalance:
            self._maybe_rebalance()
        return lengths

    def _dispatch_and_send(self, requests: list[GenRequest], lengths: list[float], priority_offset: float = 0.0) -> None:
        names = sorted(n for n, inst in self.pool.items() if not inst.retiring)
        choice = self.dispatch.assign(lengths, len(names))
        priorities = self.order.priorities(lengths)
        per_instance: dict[str, list[GenRequest]] = {}
        for r, k, prio in zip(requests, choice, priorities):
            r = replace(r, priority=prio + priority_offset)
            per_instance.setdefault(names[k], []).append(r)
            self.ledger.sent(r, names[k])
        self._gather({n: self.pool[n].actor.submit.remote(rs) for n, rs in per_instance.items()}, "submit")

    def pending(self) -> int:
        return self.ledger.pending()

    def poll(self, timeout: float = 1.0) -> list[Completion]:
        """Completions that finished since the last call (possibly none after ``timeout``)."""
        if self._early:
            out, self._early = self._early, []
            return out
        return self._poll(timeout)

    def _arm_polls(self) -> None:
        """One outstanding poll per instance with work (an idle instance's would return at once:
        a spin). Progress is asked for only while a rebalancing check could act (some instance
        has free slots: ``plan_round`` returns nothing otherwise); else a plain poll."""
        counts = self.ledger.counts(self.pool)
        want_progress = self.rebalance and has_free_slots(counts, self.cfg.generation.max_requests_per_batch)
        for name, inst in self.pool.items():
            if counts.get(name) and inst.poll is None:
                wait = min(POLL_S, self.rebalance_interval_s) if want_progress else POLL_S
                inst.poll = inst.actor.poll_with_progress.remote(wait) if want_progress else inst.actor.poll.remote(wait)
                inst.poll_due = time.perf_counter() + wait

    def _poll(self, timeout: float) -> list[Completion]:
        waiting_env = self.agent is not None and self.agent.pending()
        self._arm_polls()
        armed = {inst.poll: name for name, inst in self.pool.items() if inst.poll is not None}
        if not armed:  # nothing generating: wait for environments (if any answer) instead
            return self._wait_for_envs(timeout) if waiting_env else []
        # While environments answer, look at them often: a turn waiting on a poll would idle
        ready, rest = ray.wait(list(armed), num_returns=1, timeout=min(timeout, 0.02) if waiting_env else timeout)
        if ready and rest:  # every poll that has returned by now, not only the first
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=0)
            ready += more
        now = time.perf_counter()
        ready_set = set(ready)
        for ref, name in armed.items():  # silent for the heartbeat timeout after its own wait ended: hung
            if ref not in ready_set and name in self.pool and now - self.pool[name].poll_due > self.heartbeat_s:
                self._fail(name, f"answered no poll within generation.heartbeat_timeout_s={self.heartbeat_s:g}s")
        if now - self._live_checked >= self.heartbeat_s / 4:
            self._check_progress(now)
        out: list[Completion] = []
        for ref in ready:
            name = armed[ref]
            if name not in self.pool or self.pool[name].poll != ref:  # failed over just above
                continue
            self.pool[name].poll = None
            try:
                batch = ray.get(ref)
            except ray.exceptions.RayActorError as exc:
                self._fail(name, f"died ({type(exc).__name__}) during poll")
                continue
            if isinstance(batch, tuple):  # poll_with_progress
                batch, progress = batch
                self._set_progress(name, progress)
            else:  # a plain poll: the last progress of this instance is stale now
                self._set_progress(name, None)
            out.extend(self._hand_out(batch))
        if self.agent is not None:
            out.extend(self._advance_trajectories())
        if self.rebalance and self.ledger.pending():
            self._maybe_rebalance()
        return out

    def _hand_out(self, batch: list[Completion]) -> list[Completion]:
        """Each completion of a request in flight, joined with its prefix; duplicates are counted."""
        out = []
        for c in batch:
            if self.agent is not None and self.agent.owns(c.request_id):  # a turn: its env answers next
                self._turn_done(c)
                continue
            done = self.ledger.complete(c)
            if done is None:
                self.counters["sgs/duplicates"] += 1
                continue
            self._recent.append(done.generated)
            out.append(done)
        return out

    def generate(self, requests: list[GenRequest], predicted_lengths: Sequence[float] | None = None) -> Iterator[Completion]:
        """Submit ``requests`` and yield each completion as it finishes (completion order).

        After the last one: per-batch metrics (``take_metrics``) and the ranker/dispatch refresh."""
        lengths = self.submit(requests, predicted_lengths)
        predicted = {r.request_id: n for r, n in zip(requests, lengths)}
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
        polled itself (``predicted``: what ``submit`` returned for each request)."""
        self._end_batch(requests, predicted, done, given=False)

    def _end_batch(self, requests: list[GenRequest], predicted: dict[str, float], done: list[Completion],
                   given: bool) -> None:
        """Log the batch's ranking quality; feed its lengths to dispatch and (background) ranker."""
        lengths = {c.request_id: c.generated for c in done}  # a trajectory: the tokens it sampled
        ids = [r.request_id for r in requests]
        actual = [float(lengths[i]) for i in ids]
        self.ledger.end_batch(ids, [c.request_id for c in done])  # the last few batches' ids stay known
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
        out = {**self._metrics, "sgs/instances": float(len(self.pool)),
               **{k: float(self.counters[k]) for k in ("sgs/rebalanced", "sgs/faults", "sgs/requeued",
                                                       "sgs/restarts", "sgs/resubmitted", "sgs/duplicates",
                                                       "sgs/relay_fallbacks")},
               **(self.agent.metrics() if self.agent is not None else {})}
        self._metrics = {}
        return out

    # ------------------------------------------------------------------------------------ misc
    def stats(self) -> dict[str, dict]:
        return self._gather({n: inst.actor.stats.remote() for n, inst in self.pool.items()}, "stats")

    def drain_events(self) -> list[Event]:
        evs = self._gather({n: inst.actor.drain_events.remote() for n, inst in self.pool.items()}, "drain_events")
        return [e for batch in evs.values() for e in batch]

    def shutdown(self) -> None:
        for inst in self.pool.values():
            try:
                ray.get(inst.actor.shutdown.remote(), timeout=10)
            except Exception:  # noqa: BLE001 - best effort at teardown; the actor is killed next
                pass
            ray.kill(inst.actor)
        self.pool.clear()
        if self.ranker is not None:
            self.ranker.close()

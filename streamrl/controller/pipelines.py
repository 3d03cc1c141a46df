"""One pipeline object per mode; the driver calls ``step`` once per RL iteration.

``step(iteration, prompts) -> (samples, metrics)`` generates the iteration's samples, scores
them, trains on them and leaves the new weights installed where the mode requires. What the
mode decides (colocated or not, streaming or not, the staleness bound) comes from its
``modes.ModeSpec``; the placement plan is computed once by the driver and handed down.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray

from streamrl.config import Config
from streamrl.errors import TrainerFailed
from streamrl.metrics.timeline import Timeline
from streamrl.modes import get_mode
from streamrl.placement import PlacementPlan, trainer_labels
from streamrl.types import Completion, GenRequest, TrainResult

log = logging.getLogger(__name__)


def trainer_get(ref, what: str, timeout_s: float | None = None):
    """``ray.get`` of a call to the trainer (or the colocated worker): its death, or no answer
    within ``timeout_s`` (``run.trainer_timeout_s``), is a ``TrainerFailed`` naming the call,
    not a Ray traceback that blames whoever waited, and never a hang."""
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        raise TrainerFailed(f"the trainer answered no {what} within run.trainer_timeout_s={timeout_s:g}s "
                            "(hung, or a step slower than the limit allows)") from None
    except ray.exceptions.RayActorError as exc:
        raise TrainerFailed(f"the trainer actor died during {what} ({type(exc).__name__}); "
                            "the last checkpoint was left as it was") from None


TRAINER_START_TIMEOUT_S = 600.0
"""The least time the trainer actor gets to start and answer its first call (see ``DisaggPipeline``)."""


AHEAD_PRIORITY = 1e6
"""Partial rollout: iteration i's requests get priority offset ``-i * AHEAD_PRIORITY``, so an
engine always admits an earlier iteration's request first (order priorities are lengths)."""


def shipped_policy(cfg: Config):
    """On an existing (possibly multi-node) cluster: the policy checkpoint put in the object store
    once, for actors to write on their own node (``controller.shipping``); on the local cluster
    the driver starts: None (every actor reads ``policy.path``)."""
    if not cfg.cluster.address:
        return None
    from streamrl.models.shipping import package_policy
    from streamrl.models.hf import resolve_policy_path

    return ray.put(package_policy(resolve_policy_path(cfg.policy.path)))


def staleness_metrics(iteration: int, completions: list[Completion]) -> dict[str, float]:
    """How far behind the trainer (which trains iteration ``it`` at version ``it``) the samples
    are: per sample by its oldest token (what the bound limits), and per token."""
    if not completions:
        return {"staleness/max": 0}
    per_sample = [iteration - c.version_start for c in completions]
    per_token = [iteration - v for c in completions for v in c.versions()]
    return {"staleness/max": max(per_sample), "staleness/mean": sum(per_sample) / len(per_sample),
            "staleness/token_mean": sum(per_token) / max(len(per_token), 1),
            "staleness/mixed_samples": float(sum(len(set(c.versions())) > 1 for c in completions))}


class Pipeline:
    """What the driver calls; each mode's pipeline implements it."""

    timeline: Timeline
    cfg: Config
    lookahead: int = 1
    """How many later iterations' prompts ``step`` wants in ``upcoming``."""

    def _tget(self, ref, what: str):
        return trainer_get(ref, what, self.cfg.run.trainer_timeout_s)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        """Generate ``requests`` with the current weights (evaluation), outside any iteration."""
        raise NotImplementedError

    def step(self, iteration: int, prompts, upcoming=None):
        """One RL iteration: ``(samples, metrics)``."""
        raise NotImplementedError

    def finish(self) -> None:
        """Wait for every pending training step and install the newest weights."""

    def unreported_train_metrics(self) -> list[tuple[int, dict]]:
        """``(iteration, metrics)`` of finished training steps no ``step`` has returned yet."""
        return []

    def save(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        """Checkpoint now, after every pending training step (blocking)."""
        raise NotImplementedError

    def checkpoint(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        """Checkpoint the state after the last iteration whose ``step`` returned, without waiting
        for it where the mode allows (``save`` by default)."""
        self.save(path, extra, keep_as)

    def lineage(self) -> list[str]:
        """Every request id the current weights were trained on (restored across resumes)."""
        raise NotImplementedError

    def ranker_state(self) -> dict | None:
        return None

    def locations(self) -> dict[str, dict[str, str]]:
        """Where each worker runs now: ``{"trainer": {"node": "A0", "site": "A"}, "gen-0": ...}``."""
        return {}

    def restore_ranker(self, state: dict | None) -> None:
        """Give a resumed run's ranker the stopped run's history."""

    def can_checkpoint_at(self, iteration: int) -> bool:
        """After an interruption: whether the trainer's state is exactly "trained through
        ``iteration``" (no step on a later, unfinished iteration), so a checkpoint there is exact."""
        raise NotImplementedError

    def load(self, path: str) -> dict:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class ColocatedPipeline(Pipeline):
    """Generation and training time-share one Ray worker (see ``colocated.py``)."""

    def __init__(self, cfg: Config, ctx, plan: PlacementPlan) -> None:
        from streamrl.controller.colocated import ColocatedWorker

        self.cfg, self.ctx, self.plan = cfg, ctx, plan
        threads = cfg.cluster.num_cpus
        where = {}
        if cfg.cluster.address:  # it writes run.out_dir (checkpoints): keep it on the driver's node
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            where = {"scheduling_strategy": NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(),
                                                                           soft=False)}
        self.worker = ColocatedWorker.options(num_cpus=threads, **where, **cfg.cluster.actor_options()).remote(
            cfg, threads)
        self.timeline = Timeline()

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        completions, _ = self._tget(self.worker.generate.remote(requests), "generate")
        return completions

    def step(self, iteration: int, prompts, upcoming=None):  # no ranker here: ``upcoming`` is unused
        t0 = time.time()
        requests = self.ctx.builder.build(prompts, iteration)
        completions, gen_s = self._tget(self.worker.generate.remote(requests), f"generate (iteration {iteration})")
        t_gen_end = time.time()
        samples = [self.ctx.scorer.score(c, iteration) for c in completions]
        t_train = time.time()
        metrics = self._tget(self.worker.train.remote(samples), f"train (iteration {iteration})")
        t_end = time.time()
        self.timeline.add("colocated-0", "generate", iteration, iteration, t0, t_gen_end)
        self.timeline.add("colocated-0", "train", iteration, iteration, t_train, t_end - metrics["time/weight_sync_s"])
        self.timeline.add("colocated-0", "weight_load", iteration, iteration + 1, t_end - metrics["time/weight_sync_s"], t_end)
        gen_tokens = sum(len(c.output_ids) for c in completions)
        metrics.update({"time/gen_s": gen_s, "gen/tokens_per_s": gen_tokens / max(gen_s, 1e-9),
                        "time/step_s": time.time() - t0})
        return samples, metrics

    def finish(self) -> None:
        """Nothing is ever pending: every call blocks."""

    def save(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        self._tget(self.worker.save.remote(path, extra, keep_as), "save")

    def lineage(self) -> list[str]:
        return self._tget(self.worker.get_lineage.remote(), "lineage")

    def can_checkpoint_at(self, iteration: int) -> bool:
        # The worker runs one call at a time: this answers after an interrupted train call ends.
        return self._tget(self.worker.version.remote(), "version") == iteration + 1

    def load(self, path: str) -> dict:
        return self._tget(self.worker.load.remote(path), "load")

    def shutdown(self) -> None:
        ray.get(self.worker.shutdown.remote())
        ray.kill(self.worker)


class DisaggPipeline(Pipeline):
    """Separate generation instances (the SGS) and trainer actor; three modes.

    - ``disagg-batch``: generate the whole batch, then hand it to the trainer, then push weights.
    - ``stream-sync``: each finished group goes to the trainer at once (per-sample work on
      arrival, a step whenever ``trainer.step_tokens`` are buffered); W_{i+1} is installed
      before iteration i+1 is submitted, so every sample of iteration i comes from W_i.
    - ``stream-async``: iteration i+1 is submitted as soon as weights >= W_i are installed,
      i.e. while the trainer still trains iteration i; the trainer publishes W_{i+1} and moves
      straight on to the next groups while the instances load it (push off the critical path).

    Weight rule, for every mode: generating iteration ``it`` needs installed version
    ``>= it - max_staleness``; version v is the result of training iteration v - 1.

    The trainer actor trains in its own process (``trainer.backend=single``) or drives FSDP2
    ranks in a placement group (``fsdp``, and always on GPU); the pipeline is the same.
    """

    def __init__(self, cfg: Config, ctx, plan: PlacementPlan) -> None:
        from streamrl.sgs.service import StreamGenerationService
        from streamrl.trainer.actor import TrainerActor

        self.cfg, self.ctx, self.plan = cfg, ctx, plan
        self.mode = get_mode(cfg.mode)
        self.max_staleness = cfg.staleness_bound()
        self.partial = cfg.generation.partial_rollout
        self._ahead: dict[int, dict] = {}  # later iterations' requests, admitted early (partial rollout)
        self._admitted_ahead = 0
        self.lookahead = self.max_staleness if self.partial else 1
        if cfg.trainer.backend == "fsdp":
            # The actor only drives the FSDP2 ranks (their placement group holds the CPUs/GPUs).
            trainer_cpus = 0
        else:
            trainer_cpus = cfg.trainer.threads
        labels = {} if cfg.trainer.backend == "fsdp" else trainer_labels(cfg)  # FSDP ranks carry them in their bundles
        policy = shipped_policy(cfg)
        self.trainer = TrainerActor.options(num_cpus=trainer_cpus, resources=labels,
                                            **cfg.cluster.actor_options()).remote(
            cfg, cfg.trainer.threads, self.max_staleness, policy)
        # A trainer on another node than the driver returns its checkpoints as files (controller.shipping).
        # The first answer also waits for the actor's start (imports, loading the policy), which is
        # not a step: it gets at least TRAINER_START_TIMEOUT_S, whatever run.trainer_timeout_s says.
        limit = self.cfg.run.trainer_timeout_s
        started = trainer_get(self.trainer.node_id.remote(), "node_id (its start)",
                              None if limit is None else max(limit, TRAINER_START_TIMEOUT_S))
        self._ship = started != ray.get_runtime_context().get_node_id()
        self.sgs = StreamGenerationService(cfg, policy_path=policy, dispatch=cfg.generation.dispatch, plan=plan,
                                           fault_log=getattr(ctx, "fault_log", None))
        self.sgs.attach_prompts(ctx.task.train_prompts())  # the ranker (if any) scores the dataset ahead
        for _ in range(cfg.generation.num_instances):
            self.sgs.add_instance()
        self.sgs.update(self._tget(self.trainer.publish.remote(), "publish"), 0)
        self.pending: dict[int, ray.ObjectRef] = {}
        self.results: dict[int, TrainResult] = {}
        self._reported: set[int] = set()  # iterations whose training metrics went out with a step
        self.timeline = Timeline()
        self._last_step_end = None
        self._saves: list[ray.ObjectRef] = []  # checkpoints sent to the trainer, not yet confirmed
        self._trainer_events: ray.ObjectRef | None = None  # a drain in flight (async)
        self.scaler = None
        if cfg.generation.elastic:
            from streamrl.placement import elastic_max
            from streamrl.scheduling.elastic import ElasticScaler

            g = cfg.generation
            self.scaler = ElasticScaler(g.min_instances, elastic_max(cfg), g.scale_down_patience, g.scale_down_margin,
                                        g.scale_up_min_gain)
        self._t_train: float | None = None  # the latest finished training iteration's time

    # ------------------------------------------------------------------------------ weights
    def _result(self, it: int) -> TrainResult:
        if it not in self.results:
            self.results[it] = self._tget(self.pending.pop(it), f"training iteration {it}")
        return self.results[it]

    def _ensure_version(self, needed: int) -> None:
        if needed <= self.sgs.version:
            return
        res = self._result(needed - 1)
        self.sgs.update(res.handle, res.version)
        self._release_old_weights()

    def _release_old_weights(self) -> None:
        """Drop the handles of versions older than the installed one: each holds its weight
        buffer in the object store (the trainer owns it) for as long as a reference lives, and
        nothing needs an older version again (found by ``bench soak``: one buffer per iteration)."""
        for it, res in self.results.items():
            if res.handle is not None and res.version < self.sgs.version:
                self.results[it] = replace(res, handle=None)

    # ------------------------------------------------------------------------------- one step
    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        self._drain_ahead()
        self.finish()
        self._ensure_version(max(self.results, default=-1) + 1)
        return list(self.sgs.generate(requests))

    def step(self, iteration: int, prompts, upcoming=None):
        """One iteration; ``upcoming`` (the next iteration's prompts) is handed to the ranker to
        score ahead, after this iteration's weights are installed."""
        t0 = time.time()
        if self.max_staleness > 1 or self.partial:
            self._install_newer()  # the freshest finished version; wait only for what the bound requires
        self._ensure_version(iteration - self.max_staleness)
        if upcoming:
            self.sgs.prefetch(upcoming)
        gen_version = self.sgs.version
        t_submit = time.time()  # generation proper starts here (after any wait for the weights)
        requests = self.ctx.builder.build(prompts, iteration)
        expected = len({r.prompt_id for r in requests})
        samples, groups_open, last_ref = [], {}, None
        if not self.mode.streaming:
            completions = list(self.sgs.generate(requests))
            samples = [self.ctx.scorer.score(c, iteration) for c in completions]
            from streamrl.controller.common import group_samples

            groups = group_samples(samples) if self.cfg.trainer.algo == "grpo" else [[s] for s in samples]
            last_ref = self.trainer.add_groups.remote(iteration, groups, len(groups))
        else:
            # Stream unit: a finished group for GRPO (advantages need the group), a sample for PPO.
            n = self.cfg.generation.n_samples if self.cfg.trainer.algo == "grpo" else 1
            if n == 1:
                expected = len(requests)
            # Finished groups wait in ``outbox`` while the trainer is busy and go in one call
            # as soon as it is free: one sample at a time when the trainer keeps up, batched
            # per-sample work (one forward for many samples) when it does not. Order is kept,
            # so the dynamic-batch cut (and the update) is the same either way.
            outbox: list[list] = []
            for c in self._stream(iteration, requests, upcoming):
                s = self.ctx.scorer.score(c, iteration)
                samples.append(s)
                key = s.prompt.prompt_id if n > 1 else c.request_id
                group = groups_open.setdefault(key, [])
                group.append(s)
                if len(group) == n:
                    del groups_open[key]
                    group.sort(key=lambda x: x.sample_idx)
                    outbox.append(group)
                if outbox and (last_ref is None or not ray.wait([last_ref], timeout=0)[1]):
                    last_ref = self.trainer.add_groups.remote(iteration, outbox, expected)
                    outbox = []
            if outbox:
                last_ref = self.trainer.add_groups.remote(iteration, outbox, expected)
        gen_end = time.time()
        self.pending[iteration] = last_ref
        for c in (s.completion for s in samples):
            self.timeline.add(c.instance, "generate", iteration, c.version_start, c.t_start, c.t_end)
        metrics = {"time/gen_s": gen_end - t0, "time/gen_active_s": gen_end - t_submit, "gen/version": gen_version,
                   "gen/tokens_per_s": sum(s.num_response_tokens for s in samples) / max(gen_end - t0, 1e-9),
                   **staleness_metrics(iteration, [s.completion for s in samples]),
                   **self.sgs.take_metrics()}  # ranker recall/Spearman of this batch, rebalancing counters
        if self.partial:
            metrics.update({"gen/admitted_ahead": float(self._admitted_ahead), "gen/iterations_ahead": float(len(self._ahead))})
            self._admitted_ahead = 0
        if self.max_staleness == 0:
            res = self._result(iteration)
            self.sgs.update(res.handle, res.version)
            self._release_old_weights()
            metrics.update(res.metrics)
            self._reported.add(iteration)
        else:
            # Never block here: the trainer may still be on iteration - 1 (that is the overlap).
            for it in [it for it, ref in self.pending.items() if it < iteration]:
                if ray.wait([self.pending[it]], timeout=0)[0]:
                    self._result(it)
            # The oldest finished training step not reported yet (usually iteration - 1; one
            # that finished late is reported here, not lost), named by ``train/iteration``.
            late = sorted(set(self.results) - self._reported)
            if late:
                metrics.update(self.results[late[0]].metrics)
                metrics["train/iteration"] = late[0]
                self._reported.add(late[0])
        if self.scaler is not None:
            metrics.update(self._scale(metrics, samples))
        metrics["time/step_s"] = time.time() - (self._last_step_end or t0)
        self._last_step_end = time.time()
        # Instance events only: a call to the trainer actor would queue behind its training
        # work and turn the asynchronous pipeline back into a synchronous one.
        self._collect_events(trainer=self.max_staleness == 0 or None)
        return samples, metrics

    # ------------------------------------------------------------------ partial rollout
    def _install_newer(self) -> None:
        """Install the newest finished training result if it is newer than the installed version
        (never waits on the trainer). With partial rollout this runs while requests are in flight:
        the instances switch between two decode steps and each token records its version."""
        for it in sorted(self.pending):
            if it not in self.results and ray.wait([self.pending[it]], timeout=0)[0]:
                self._result(it)
        newest = max((r for r in self.results.values() if r.handle is not None), key=lambda r: r.version, default=None)
        if newest is not None and newest.version > self.sgs.version:
            self.sgs.update(newest.handle, newest.version)
            self._release_old_weights()

    def _stream(self, iteration: int, requests: list[GenRequest], upcoming):
        """This iteration's completions as they finish. With partial rollout, new versions are
        installed as the trainer publishes them, and later iterations' requests (``upcoming``:
        the next ``lookahead`` batches) are admitted while the SGS has free batch slots and the
        staleness bound allows (installed version >= that iteration - k: admission control,
        nothing is discarded); each iteration's requests rank behind every earlier one's in the
        engines, so they only fill slots the earlier ones leave free. Their completions wait for
        their own ``step``."""
        if not self.partial:
            yield from self.sgs.generate(requests)
            return
        ppi = self.cfg.generation.prompts_per_iter
        future = [upcoming[i * ppi:(i + 1) * ppi] for i in range(len(upcoming or []) // ppi)]
        state = self._ahead.pop(iteration, None)
        ids = [r.request_id for r in requests]
        if state is None:
            state = self._admit(iteration, requests)
        elif state["ids"] != ids:
            raise RuntimeError(f"iteration {iteration}: the requests admitted ahead ({len(state['ids'])}) are not "
                               f"this iteration's ({len(ids)})")
        yield from state["done"]
        while state["wanted"]:
            self._install_newer()
            self._admit_ahead(iteration, future)
            for c in self.sgs.poll():
                owner = state if c.request_id in state["wanted"] else next(
                    (a for a in self._ahead.values() if c.request_id in a["wanted"]), None)
                if owner is None:
                    raise RuntimeError(f"completion {c.request_id!r} belongs to no iteration in flight")
                owner["wanted"].discard(c.request_id)
                owner["done"].append(c)
                if owner is state:
                    yield c
        self.sgs.finish_batch(requests, state["predicted"], state["done"])

    def _admit(self, iteration: int, requests: list[GenRequest]) -> dict:
        """Submit one iteration's requests; an earlier iteration's always rank first."""
        self.sgs.submit(requests, priority_offset=-AHEAD_PRIORITY * iteration)
        ids = [r.request_id for r in requests]
        return {"ids": ids, "wanted": set(ids), "done": [], "predicted": {i: self.sgs.predicted[i] for i in ids}}

    def _admit_ahead(self, iteration: int, future: list) -> None:
        capacity = len(self.sgs.instances) * self.cfg.generation.max_requests_per_batch
        while True:
            nxt = max([iteration, *self._ahead]) + 1
            if (nxt - iteration - 1 >= len(future) or self.sgs.version < nxt - self.max_staleness
                    or self.sgs.pending() >= capacity):
                return
            self._ahead[nxt] = self._admit(nxt, self.ctx.builder.build(future[nxt - iteration - 1], nxt))
            self._admitted_ahead += len(self._ahead[nxt]["ids"])

    def _drain_ahead(self) -> None:
        """Let the requests admitted ahead finish (they wait for their ``step``), so a call that
        polls the SGS itself (an evaluation) sees only its own completions."""
        while any(a["wanted"] for a in self._ahead.values()):
            for c in self.sgs.poll():
                owner = next((a for a in self._ahead.values() if c.request_id in a["wanted"]), None)
                if owner is None:
                    raise RuntimeError(f"completion {c.request_id!r} belongs to no iteration in flight")
                owner["wanted"].discard(c.request_id)
                owner["done"].append(c)

    def _room_for_instance(self) -> bool:
        """Whether Ray could place one more instance now (an add must never wait on resources
        that are not there: the run would stall for ``generation.replacement_timeout_s``)."""
        need = self.sgs._instance_options(self.sgs.counters["sgs/instances_added"])
        free = ray.available_resources()
        wants = {"CPU": need.get("num_cpus", 0), "GPU": need.get("num_gpus", 0), **need.get("resources", {})}
        return all(free.get(k, 0.0) + 1e-9 >= v for k, v in wants.items() if v)

    def _scale(self, metrics: dict, samples) -> dict[str, float]:
        """Elastic SGS, between two iterations (no request in flight): T_gen of this iteration
        against the latest finished T_train (prepare included); one instance more or fewer, as
        ``ElasticScaler`` decides; a new instance installs the current weights first."""
        if "time/train_s" in metrics:
            self._t_train = metrics["time/train_s"] + metrics.get("time/prepare_s", 0.0)
        k = len(self.sgs.instances)
        out = {"elastic/decision": 0.0, "gen/instances": float(k)}
        if self._t_train is None or not samples:
            return out
        t_gen = metrics["time/gen_active_s"]  # not the wait for the trainer's weights (async: its bottleneck)
        t_tail = max(s.completion.t_end - s.completion.t_start for s in samples)
        decision = self.scaler.decide(k, t_gen, self._t_train, t_tail)
        if decision > 0 and not self._room_for_instance():
            log.warning("elastic: one more generation instance was due, but Ray has no room for it now (%s)",
                        ray.available_resources())
            out["elastic/blocked"] = 1.0
            decision = 0
        if decision > 0:
            self.sgs.add_instance()
        elif decision < 0:
            self.sgs.retire_instance(list(self.sgs.instances)[-1])  # the newest goes first
        out.update({"elastic/decision": float(decision), "gen/instances": float(len(self.sgs.instances)),
                    "elastic/t_gen_s": t_gen, "elastic/t_train_s": self._t_train, "elastic/t_tail_s": t_tail})
        return out

    def unreported_train_metrics(self) -> list[tuple[int, dict]]:
        """``(iteration, metrics)`` of finished training steps no ``step`` has returned yet (the
        last ones of an asynchronous run, after ``finish``); each is returned once."""
        late = sorted(set(self.results) - self._reported)
        self._reported.update(late)
        return [(it, {**self.results[it].metrics, "train/iteration": it}) for it in late]

    def finish(self) -> None:
        """Wait for every pending training result and checkpoint, and install the newest weights."""
        for it in sorted(self.pending):
            self._result(it)
        while self._saves:
            ref, path, keep_as = self._saves.pop(0)
            self._written(self._tget(ref, "checkpoint"), path, keep_as)
        if self.results:
            last = self.results[max(self.results)]
            if last.version > self.sgs.version:
                self.sgs.update(last.handle, last.version)
            self._release_old_weights()
        self._collect_events()

    def _collect_events(self, trainer: bool | None = True) -> None:
        """Instance and trainer events into the timeline. ``trainer=None`` (async): never wait on
        the trainer (a call queues behind its training and would make the pipeline synchronous):
        a drain sent earlier is collected if it has returned, and another is sent, so the
        trainer's events do not pile up in it over a long run."""
        evs = self.sgs.drain_events()
        if trainer:
            if self._trainer_events is not None:
                evs += self._tget(self._trainer_events, "drain_events")
                self._trainer_events = None
            evs += self._tget(self.trainer.drain_events.remote(), "drain_events")
        elif trainer is None:
            if self._trainer_events is not None and ray.wait([self._trainer_events], timeout=0)[0]:
                evs += self._tget(self._trainer_events, "drain_events")
                self._trainer_events = None
            if self._trainer_events is None:
                self._trainer_events = self.trainer.drain_events.remote()
        self.timeline.extend(evs)

    def locations(self) -> dict[str, dict[str, str]]:
        where = {"trainer": self._tget(self.trainer.location.remote(), "location"), **self.sgs.locations}
        return {name: {"node": loc.node, "site": loc.site} for name, loc in where.items()}

    def trained_ids(self) -> list[str]:
        return self._tget(self.trainer.drain_trained_ids.remote(), "drain_trained_ids")

    def save(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        self.finish()
        self._written(self._tget(self.trainer.save.remote(path, extra, keep_as, self._ship), "save"), path, keep_as)

    def checkpoint(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        """No drain: the trainer actor runs calls in order, so a ``save`` sent now runs right after
        the last ``add_groups`` of the iteration that just returned and before any group of the
        next one, while the instances go on generating; its errors surface at ``finish``."""
        self._saves.append((self.trainer.save.remote(path, extra, keep_as, self._ship), path, keep_as))

    @staticmethod
    def _written(files: dict | None, path: str, keep_as: str | None) -> None:
        """Write a checkpoint a trainer on another node returned (``files``; None: it wrote it)."""
        if files is None:
            return
        from streamrl.models.shipping import unpack_dir

        unpack_dir(files["checkpoint"], path)
        if keep_as and files["keep"] is not None:
            unpack_dir(files["keep"], keep_as)

    def lineage(self) -> list[str]:
        return self._tget(self.trainer.get_lineage.remote(), "lineage")

    def ranker_state(self) -> dict | None:
        return self.sgs.ranker.history_state() if self.sgs.ranker is not None else None

    def restore_ranker(self, state: dict | None) -> None:
        if self.sgs.ranker is not None:
            self.sgs.ranker.restore(state)

    def can_checkpoint_at(self, iteration: int) -> bool:
        self.finish()  # every iteration whose step returned is trained and installed
        partial = self._tget(self.trainer.partial_steps.remote(), "partial_steps")
        return partial == 0 and self._tget(self.trainer.version.remote(), "version") == iteration + 1

    def load(self, path: str) -> dict:
        from streamrl.models.shipping import pack_dir

        extra = self._tget(self.trainer.load.remote(pack_dir(path) if self._ship else path), "load")
        self.sgs.update(self._tget(self.trainer.publish.remote(), "publish"), self._tget(self.trainer.version.remote(), "version"))
        return extra

    def shutdown(self) -> None:
        self.sgs.shutdown()
        if self.cfg.trainer.backend == "fsdp":
            ray.get(self.trainer.shutdown.remote())  # ranks and placement group
        ray.kill(self.trainer)

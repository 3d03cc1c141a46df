"""The disaggregated pipeline: generation instances (the SGS) and a trainer actor, three modes.

- ``disagg-batch``: generate the whole batch, then hand it to the trainer, then push weights.
- ``stream-sync``: each finished group goes to the trainer at once; W_{i+1} is installed before
  iteration i+1 is submitted, so every sample of iteration i comes from W_i.
- ``stream-async``: iteration i+1 is submitted once weights >= W_i are installed, while the
  trainer still trains iteration i; the push is off the critical path.

Weight rule, every mode: generating iteration ``it`` needs installed version ``>= it - k``
(``max_staleness``); version v is the result of training iteration v - 1. How an iteration's
requests reach the trainer is the ``strategies`` module's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray

from streamrl.config import Config
from streamrl.controller.pipeline import TRAINER_START_TIMEOUT_S, Pipeline, shipped_policy, staleness_metrics, trainer_get
from streamrl.controller.strategies import LookAhead, Streaming, WholeBatch
from streamrl.metrics.timeline import Timeline
from streamrl.modes import get_mode
from streamrl.placement import PlacementPlan, elastic_max, trainer_labels
from streamrl.types import Completion, GenRequest, TrainResult

log = logging.getLogger(__name__)


class DisaggPipeline(Pipeline):
    """Separate generation instances (the SGS) and trainer actor. The trainer actor trains in
    its own process (``trainer.backend=single``) or drives FSDP2 ranks in a placement group
    (``fsdp``, and always on GPU); the pipeline is the same."""

    def __init__(self, cfg: Config, ctx, plan: PlacementPlan) -> None:
        from streamrl.sgs.service import StreamGenerationService
        from streamrl.trainer.actor import TrainerActor

        self.cfg, self.ctx, self.plan = cfg, ctx, plan
        self.mode = get_mode(cfg.mode)
        self.max_staleness = cfg.staleness_bound()
        self.partial = cfg.generation.partial_rollout
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
        # The first answer waits for the actor's start (imports, loading the policy), which is not a
        # step: it gets at least TRAINER_START_TIMEOUT_S, whatever run.trainer_timeout_s says.
        limit = self.cfg.run.trainer_timeout_s
        started = self.trainer.node_id.remote()
        wait_start = lambda: trainer_get(started, "node_id (its start)",  # noqa: E731
                                         None if limit is None else max(limit, TRAINER_START_TIMEOUT_S))
        # FSDP ranks reserve their placement group first (instances could otherwise take its CPUs);
        # a single trainer loads while the instances load.
        self.sgs = None
        try:
            node = wait_start() if cfg.trainer.backend == "fsdp" else None
            self.sgs = StreamGenerationService(cfg, policy_path=policy, dispatch=cfg.generation.dispatch, plan=plan,
                                               fault_log=getattr(ctx, "fault_log", None))
            self.sgs.agent = getattr(ctx, "agent", None)  # multi-turn trajectories (task.env / task.tools)
            self.sgs.attach_prompts(ctx.task.train_prompts())  # the ranker (if any) scores the dataset ahead
            self.sgs.add_instances(cfg.generation.num_instances)
            node = node if node is not None else wait_start()
            self.sgs.update(self._tget(self.trainer.publish.remote(), "publish"), 0)
        except BaseException:  # a half-built pipeline stops what it started (no actor is left to the GC)
            if self.sgs is not None:
                self.sgs.shutdown()
            ray.kill(self.trainer)
            raise
        # A trainer on another node than the driver returns its checkpoints as files (models.shipping).
        self._ship = node != ray.get_runtime_context().get_node_id()
        self.strategy = (LookAhead(self) if self.partial else Streaming(self) if self.mode.streaming
                         else WholeBatch(self))
        self.pending: dict[int, ray.ObjectRef] = {}
        self.results: dict[int, TrainResult] = {}
        self._reported: set[int] = set()  # iterations whose training metrics went out with a step
        self.timeline = Timeline()
        self._last_step_end = None
        self._saves: list[ray.ObjectRef] = []  # checkpoints sent to the trainer, not yet confirmed
        self._trainer_events: ray.ObjectRef | None = None  # a drain in flight (async)
        self.scaler = None
        if cfg.generation.elastic:
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
        self.strategy.drain()
        self.finish()
        self._ensure_version(max(self.results, default=-1) + 1)
        return list(self.sgs.generate(requests))

    def step(self, iteration: int, prompts, upcoming=None):
        """One iteration; ``upcoming`` (the next iterations' prompts) is handed to the ranker to
        score ahead, after this iteration's weights are installed."""
        t0 = time.time()
        if self.max_staleness > 1 or self.partial:
            self.install_newer()  # the freshest finished version; wait only for what the bound requires
        self._ensure_version(iteration - self.max_staleness)
        if upcoming:
            self.sgs.prefetch(upcoming)
        gen_version = self.sgs.version
        t_submit = time.time()  # generation proper starts here (after any wait for the weights)
        requests = self.strategy.built_ahead(iteration) or self.ctx.builder.build(prompts, iteration)
        samples, self.pending[iteration] = self.strategy.run(iteration, requests, upcoming)
        gen_end = time.time()
        for c in (s.completion for s in samples):
            self.timeline.add(c.instance, "generate", iteration, c.version_start, c.t_start, c.t_end)
        metrics = {"time/gen_s": gen_end - t0, "time/gen_active_s": gen_end - t_submit, "gen/version": gen_version,
                   # the engines' rate while this iteration generates: not the wait for its weights, which in
                   # async modes is the trainer's time (counting it made generation look 2-3x slower beside training)
                   "gen/tokens_per_s": sum(s.num_response_tokens for s in samples) / max(gen_end - t_submit, 1e-9),
                   **staleness_metrics(iteration, [s.completion for s in samples]),
                   **self.sgs.take_metrics(),  # ranker recall/Spearman of this batch, rebalancing counters
                   **self.strategy.metrics(), **self._train_metrics(iteration)}
        if self.scaler is not None:
            metrics.update(self._scale(metrics, samples))
        metrics["time/step_s"] = time.time() - (self._last_step_end or t0)
        self._last_step_end = time.time()
        # Instance events only: a call to the trainer actor would queue behind its training
        # work and turn the asynchronous pipeline back into a synchronous one.
        self._collect_events(trainer=self.max_staleness == 0 or None)
        return samples, metrics

    def _train_metrics(self, iteration: int) -> dict[str, float]:
        """Synchronous: wait for this iteration's training and install its weights. Otherwise never
        block (the trainer may still be on iteration - 1: that is the overlap) and report the
        oldest finished step not reported yet (one that finished late is reported here, not lost)."""
        if self.max_staleness == 0:
            res = self._result(iteration)
            self.sgs.update(res.handle, res.version)
            self._release_old_weights()
            self._reported.add(iteration)
            return dict(res.metrics)
        for it in [it for it in self.pending if it < iteration]:
            if ray.wait([self.pending[it]], timeout=0)[0]:
                self._result(it)
        late = sorted(set(self.results) - self._reported)
        if not late:
            return {}
        self._reported.add(late[0])
        return {**self.results[late[0]].metrics, "train/iteration": late[0]}

    # ------------------------------------------------------------------ weights mid-run
    def install_newer(self) -> None:
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
        if decision > 0 and not self.sgs.room_for_instance():
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

    def peak_memory(self) -> dict[str, dict[str, float]]:
        refs = {"trainer": self.trainer.peak_memory_mb.remote(),
                **{name: actor.peak_memory_mb.remote() for name, actor in self.sgs.instances.items()}}
        out = {}
        for name, ref in refs.items():
            try:
                out[name] = ray.get(ref, timeout=30)
            except Exception:  # noqa: BLE001 - an instance lost at the end has no peak to give
                continue
        return out

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

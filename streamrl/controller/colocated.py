"""Colocated mode: the baseline users run today (verl-style time sharing).

One Ray worker (``ColocatedWorker``, all CPUs) holds both the generation engine and the trainer
and alternates: ``generate(requests)`` runs the whole batch (continuous batching), the driver
scores it, ``train(samples)`` steps and installs W_{i+1} in the engine. The driver blocks on each
call, so generation and training never overlap: the cost the disaggregated modes remove.
"""

from __future__ import annotations

import time

import ray

from streamrl.config import Config
from streamrl.controller.pipeline import Pipeline
from streamrl.metrics.timeline import Timeline
from streamrl.placement import PlacementPlan
from streamrl.sgs.engines.build import engine_kwargs, run_to_completion
from streamrl.types import Completion, GenRequest, Sample


@ray.remote
class ColocatedWorker:
    """Engine and trainer in one process, time-sharing its CPUs."""

    def __init__(self, cfg: Config, threads: int) -> None:
        from streamrl.memory import watch_private_memory
        from streamrl.sgs.engines.base import make_engine

        watch_private_memory()
        from streamrl.trainer.trainer import Trainer

        cfg = cfg.model_copy(deep=True)
        cfg.trainer.threads = threads
        self.trainer = Trainer(cfg)
        engine_model = self.trainer.plain_copy().eval()
        self.engine = make_engine(cfg.generation.engine, engine_model,
                                  **engine_kwargs(cfg, self.trainer.tokenizer, threads, "colocated-0", cfg.run.seed))
        self.algo = cfg.trainer.algo
        self.lineage: list[str] = []  # every request id the current weights were trained on: checkpointed

    def generate(self, requests: list[GenRequest]) -> tuple[list[Completion], float]:
        t0 = time.time()
        return run_to_completion(self.engine, requests), time.time() - t0

    def train(self, samples: list[Sample]) -> dict[str, float]:
        from streamrl.controller.common import group_samples

        t0 = time.time()
        tr = self.trainer
        tr.begin_iteration()
        units = group_samples(samples) if self.algo == "grpo" else [[s] for s in samples]
        groups = tr.prepare_groups(units)
        if self.algo == "grpo":
            tr.set_group_advantages(groups)
        metrics = tr.train_iteration(groups)
        self.lineage.extend(s.completion.request_id for s in samples)
        train_s = time.time() - t0
        t1 = time.time()
        version = tr.finish_iteration()
        self._install(version)
        metrics.update({"time/train_s": train_s, "time/weight_sync_s": time.time() - t1, "policy/version": version,
                        "train/tokens_per_s": sum(s.completion.prompt_ids.__len__() + s.num_response_tokens
                                                  for s in samples) / max(train_s, 1e-9)})
        return metrics

    def version(self) -> int:
        return self.trainer.version

    def save(self, path: str, extra: dict, keep_as: str | None = None) -> None:
        self.trainer.save_checkpoint(path, {**extra, "lineage": list(self.lineage)})
        if keep_as:
            import shutil

            shutil.copytree(f"{path}/policy", keep_as, dirs_exist_ok=True)

    def peak_memory_mb(self) -> dict[str, float]:
        from streamrl.memory import peaks_mb

        return peaks_mb()

    def get_lineage(self) -> list[str]:
        return list(self.lineage)

    def load(self, path: str) -> dict:
        extra = self.trainer.load_checkpoint(path)
        self.lineage = list(extra.pop("lineage", []))
        self._install(self.trainer.version)
        return extra

    def _install(self, version: int) -> None:
        """The trainer's weights into the engine: the whole state, or with LoRA the adapter."""
        from streamrl.models.lora import install

        install(self.engine, self.trainer.policy_state(), version, self.trainer.tcfg.lora)

    def shutdown(self) -> None:
        self.engine.shutdown()


class ColocatedPipeline(Pipeline):
    """Generation and training time-share one Ray worker (``ColocatedWorker``)."""

    def __init__(self, cfg: Config, ctx, plan: PlacementPlan) -> None:
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
        samples = self.ctx.scorer.score_many(completions, iteration)
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

    def peak_memory(self) -> dict[str, dict[str, float]]:
        return {"colocated-0": self._tget(self.worker.peak_memory_mb.remote(), "peak_memory_mb")}

    def can_checkpoint_at(self, iteration: int) -> bool:
        # The worker runs one call at a time: this answers after an interrupted train call ends.
        return self._tget(self.worker.version.remote(), "version") == iteration + 1

    def load(self, path: str) -> dict:
        return self._tget(self.worker.load.remote(path), "load")

    def shutdown(self) -> None:
        ray.get(self.worker.shutdown.remote())
        ray.kill(self.worker)

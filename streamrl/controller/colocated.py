"""Colocated mode: the baseline users run today (verl-style time sharing).

One Ray worker (the worker group, of size one on a laptop) holds both the generation engine and
the trainer and alternates between them; nothing overlaps::

    driver                              ColocatedWorker (Ray actor, all CPUs)
    ------                              -------------------------------------
    prompts -> requests ---------------> generate(requests): engine runs the whole batch
                                          (continuous batching: a finished request frees
                                          its slot at once; no static batch waits for its
                                          longest member), returns completions
    score (verifiable reward) <---------
    samples ---------------------------> train(samples): prepare -> advantages -> optimizer
                                          steps -> install weights W_{i+1} in the engine
    metrics <---------------------------

The driver blocks on each call: generation and training never run at the same time, which is
exactly the cost the disaggregated modes remove.
"""

from __future__ import annotations

import copy
import time

import ray

from streamrl.config import Config
from streamrl.sgs.engines.build import engine_kwargs, run_to_completion
from streamrl.types import Completion, GenRequest, Sample


@ray.remote
class ColocatedWorker:
    """Engine and trainer in one process, time-sharing its CPUs."""

    def __init__(self, cfg: Config, threads: int) -> None:
        from streamrl.sgs.engines.base import make_engine
        from streamrl.trainer.trainer import Trainer

        cfg = cfg.model_copy(deep=True)
        cfg.trainer.threads = threads
        self.trainer = Trainer(cfg)
        engine_model = copy.deepcopy(self.trainer.model).eval()
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
        self.engine.update_weights(tr.policy_state(), version)
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

    def get_lineage(self) -> list[str]:
        return list(self.lineage)

    def load(self, path: str) -> dict:
        extra = self.trainer.load_checkpoint(path)
        self.lineage = list(extra.pop("lineage", []))
        self.engine.update_weights(self.trainer.policy_state(), self.trainer.version)
        return extra

    def shutdown(self) -> None:
        self.engine.shutdown()

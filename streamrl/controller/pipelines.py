"""One pipeline object per mode; the driver calls ``step`` once per RL iteration.

``step(iteration, prompts) -> (samples, metrics)`` generates the iteration's samples, scores
them, trains on them and leaves the new weights installed where the mode requires.
"""

from __future__ import annotations

import time

import ray

from streamrl.config import Config
from streamrl.types import Completion, GenRequest


class ColocatedPipeline:
    """Generation and training time-share one Ray worker (see ``colocated.py``)."""

    def __init__(self, cfg: Config, ctx) -> None:
        from streamrl.controller.colocated import ColocatedWorker

        self.cfg, self.ctx = cfg, ctx
        threads = cfg.cluster.num_cpus
        self.worker = ColocatedWorker.options(num_cpus=threads).remote(cfg.model_dump(), threads)

    def generate(self, requests: list[GenRequest]) -> list[Completion]:
        completions, _ = ray.get(self.worker.generate.remote(requests))
        return completions

    def step(self, iteration: int, prompts):
        t0 = time.time()
        requests = self.ctx.builder.build(prompts, iteration)
        completions, gen_s = ray.get(self.worker.generate.remote(requests))
        samples = [self.ctx.scorer.score(c, iteration) for c in completions]
        metrics = ray.get(self.worker.train.remote(samples))
        gen_tokens = sum(len(c.output_ids) for c in completions)
        metrics.update({"time/gen_s": gen_s, "gen/tokens_per_s": gen_tokens / max(gen_s, 1e-9),
                        "time/step_s": time.time() - t0})
        return samples, metrics

    def save(self, path: str, extra: dict) -> None:
        ray.get(self.worker.save.remote(path, extra))

    def load(self, path: str) -> dict:
        return ray.get(self.worker.load.remote(path))

    def shutdown(self) -> None:
        ray.get(self.worker.shutdown.remote())
        ray.kill(self.worker)

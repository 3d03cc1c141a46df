"""``Config``: the whole run, one field per section, and the checks across sections.

The checks across sections are here (staleness against the mode, the trainer backend against
device and algorithm, the GPU engine against the device); what depends on the placement plan
(pins on one colocated worker, whether the described cluster holds the run) is checked by
``streamrl.placement.plan_placement``, before any work.
"""

from __future__ import annotations

from typing import Literal

from pydantic import model_validator

from streamrl.config.base import _Section
from streamrl.config.cluster import ClusterConfig
from streamrl.config.generation import GenerationConfig
from streamrl.config.logs import LoggingConfig
from streamrl.config.placement import PlacementConfig
from streamrl.config.policy import PolicyConfig
from streamrl.config.ranker import RankerConfig
from streamrl.config.run import RunConfig
from streamrl.config.task import TaskConfig
from streamrl.config.trainer import TrainerConfig
from streamrl.config.weights import WeightsConfig
from streamrl.modes import MODE_NAMES


class Config(_Section):
    mode: Literal[MODE_NAMES] = "colocated"
    """pipeline: colocated (one worker: generate, then train) | disagg-batch (separate workers, whole batches) |
    stream-sync (train on finished samples during generation) | stream-async (also generate iteration i+1 while
    training i: staleness 1)"""
    run: RunConfig = RunConfig()
    cluster: ClusterConfig = ClusterConfig()
    policy: PolicyConfig = PolicyConfig()
    task: TaskConfig = TaskConfig()
    generation: GenerationConfig = GenerationConfig()
    trainer: TrainerConfig = TrainerConfig()
    ranker: RankerConfig = RankerConfig()
    logging: LoggingConfig = LoggingConfig()
    placement: PlacementConfig = PlacementConfig()
    weights: WeightsConfig = WeightsConfig()

    def wire_dtype(self) -> str:
        """``weights.wire_dtype``, or the engines' own dtype when it is None (bf16 on cuda)."""
        if self.weights.wire_dtype is not None:
            return self.weights.wire_dtype
        engine_dtype = str(self.generation.vllm.get("dtype", "bfloat16")).replace("torch.", "")
        return "bfloat16" if self.placement.device == "cuda" and engine_dtype not in ("float32", "float") else "float32"

    def staleness_bound(self) -> int:
        """The staleness bound k the run holds: ``trainer.max_staleness``, else the mode's."""
        from streamrl.modes import get_mode

        k = self.trainer.max_staleness
        return get_mode(self.mode).max_staleness if k is None else k

    @model_validator(mode="after")
    def _staleness_fits_the_mode(self) -> "Config":
        from streamrl.modes import get_mode

        k, mode = self.trainer.max_staleness, get_mode(self.mode)
        if k is not None and k != mode.max_staleness and mode.max_staleness == 0:
            raise ValueError(f"trainer.max_staleness={k}: mode={self.mode!r} is synchronous (staleness 0); a bound "
                             "above 0 needs mode=stream-async")
        if k == 0 and mode.max_staleness > 0:
            raise ValueError("trainer.max_staleness=0 in mode='stream-async': a synchronous run is mode=stream-sync")
        if self.generation.partial_rollout and mode.max_staleness == 0:
            raise ValueError(f"generation.partial_rollout=true needs mode=stream-async (mode={self.mode!r} installs "
                             "weights only between iterations, with no request in flight)")
        return self

    @model_validator(mode="after")
    def _trainer_backend_fits(self) -> "Config":
        """The FSDP2 trainer group trains GRPO without a reference or critic, beside separate
        generation instances; a GPU run trains with it and nothing else."""
        t, p = self.trainer, self.placement
        if p.device == "cuda" and self.mode == "colocated":
            raise ValueError("placement.device=cuda runs the disaggregated modes (trainer and generation on separate "
                             "GPUs): mode='colocated' is not supported on GPU")
        if p.device == "cuda" and t.backend != "fsdp":
            raise ValueError(f"placement.device=cuda trains with FSDP2 over placement.trainer_gpus={p.trainer_gpus} "
                             f"ranks: set trainer.backend=fsdp (got trainer.backend={t.backend!r})")
        if t.backend == "fsdp":
            if self.mode == "colocated":
                raise ValueError("trainer.backend='fsdp' needs a disaggregated mode (disagg-batch, stream-sync, "
                                 "stream-async): mode='colocated' time-shares one worker and is not supported")
            if t.algo != "grpo":
                raise ValueError(f"trainer.backend='fsdp' trains GRPO only (no critic): trainer.algo={t.algo!r} "
                                 "is not supported")
            if t.kl_coef > 0:
                raise ValueError(f"trainer.backend='fsdp' has no reference model: trainer.kl_coef={t.kl_coef} is "
                                 "not supported (set it to 0)")
            if t.entropy_coef > 0:
                raise ValueError(f"trainer.backend='fsdp' has no entropy bonus: trainer.entropy_coef={t.entropy_coef} "
                                 "is not supported (set it to 0)")
            if t.correction == "decoupled" and t.epochs > 1:
                raise ValueError(f"trainer.correction='decoupled' with trainer.epochs={t.epochs} is not supported on "
                                 "trainer.backend='fsdp' (the proximal log-probs would not be kept across epochs)")
        if self.generation.top_p < 1 and t.correction != "none":
            raise ValueError(f"generation.top_p={self.generation.top_p} with trainer.correction={t.correction!r}: the "
                             "engines' log-probs are of the top-p-truncated distribution and the trainer's are not, so "
                             "the importance ratios would be biased; use top_p=1 or correction='none'")
        return self


    @model_validator(mode="after")
    def _lora_fits(self) -> "Config":
        """Every engine and trainer backend takes LoRA; the reweighted ranker does not yet."""
        if self.trainer.lora.rank > 0 and self.ranker.name == "reweighted":
            raise ValueError(f"trainer.lora.rank={self.trainer.lora.rank} with ranker.name='reweighted': that ranker "
                             "scores with full policy weights and does not apply adapters yet")
        return self

    @model_validator(mode="after")
    def _multi_turn_fits(self) -> "Config":
        """Trajectories run through the SGS (not the colocated worker) and train with GRPO."""
        if not self.task.multi_turn:
            return self
        what = f"task.env={self.task.env!r}" if self.task.env else f"task.tools={self.task.tools}"
        if self.mode == "colocated":
            raise ValueError(f"{what}: multi-turn rollouts run in the disaggregated modes (disagg-batch, stream-sync, "
                             "stream-async), not mode='colocated'")
        if self.trainer.algo != "grpo":
            raise ValueError(f"{what}: multi-turn rollouts train with trainer.algo='grpo' (got {self.trainer.algo!r}: "
                             "a critic over environment tokens is not supported)")
        if self.ranker.name == "reweighted":
            raise ValueError(f"{what} with ranker.name='reweighted': that ranker scores single responses")
        return self

    @model_validator(mode="after")
    def _gpu_generation_is_vllm_on_cuda(self) -> "Config":
        """On ``placement.device=cuda`` generation is vLLM on the GPUs. Whether the cluster holds
        the run is ``streamrl.placement.plan_placement``'s check."""
        g = self.generation
        if self.placement.device == "cuda" and g.engine != "vllm":
            raise ValueError(f"placement.device=cuda needs generation.engine=vllm (got {g.engine!r}); the "
                             "transformers backend is the CPU engine")
        if self.placement.device == "cuda" and g.vllm.get("device", "cpu") != "cuda":
            raise ValueError(f"placement.device=cuda but generation.vllm.device={g.vllm.get('device', 'cpu')!r}; "
                             "set generation.vllm.device=cuda")
        return self

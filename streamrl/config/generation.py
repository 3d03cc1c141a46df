"""``generation``: sampling, scheduling and the instances of the stream generation service.

Fields come in groups (sampling; dispatch and order; rebalancing; elastic; faults and
heartbeats; engine and memory); keys are read by name, so their order changes no config.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from streamrl.config.base import _choice, _Section


class GenerationConfig(_Section):
    # Sampling: what each iteration asks the policy for.
    temperature: float = Field(1.0, gt=0)
    """sampling temperature"""
    top_p: float = Field(1.0, gt=0, le=1)
    """nucleus sampling: the smallest token set holding this probability mass; 1 = off"""
    max_new_tokens: int = Field(200, ge=1)
    """longest response, in tokens"""
    n_samples: int = Field(8, ge=1)
    """samples per prompt (GRPO group size)"""
    prompts_per_iter: int = Field(16, ge=1)
    """prompts per iteration (each sampled n_samples times)"""

    # Dispatch and order: which instance gets a request, and when it is admitted there.
    dispatch: str = "round-robin"
    """dispatch policy: random | round-robin | least-loaded | skewness-aware | skewness-search"""
    order: Literal["fifo", "lpt", "lpt-head"] = "fifo"
    """admission order inside an instance: arrival; longest predicted first (needs the ranker); or that for the
    order_head fraction predicted longest, then arrival"""
    order_head: float = Field(0.1, gt=0, le=1)
    """lpt-head: the fraction admitted longest-first"""
    latency_profile: str | None = None
    """PTL profile JSON (`streamrl profile`) read by skewness-aware dispatch and rebalancing; None = the paper's H800
    table"""
    skew_alpha: float = Field(0.2, gt=0, lt=1)
    """skewness-aware dispatch: long-tail fraction"""
    partial_rollout: bool = False
    """stream-async: a new policy version is installed on the instances as soon as the trainer publishes it, between
    two decode steps of the running requests (each token records the version that sampled it), and the next
    iteration's prompts are admitted into free batch slots while the staleness bound allows, so the long tail no
    longer idles the instances"""

    # Rebalancing: moving requests between instances while they run.
    rebalance: bool = False
    """move requests off an instance whose predicted remaining work exceeds the least loaded one's while some
    instance has free slots (beyond the paper)"""
    rebalance_threshold: float = Field(0.25, ge=0, lt=1)
    """rebalance when (T_max - T_min) > this x T_max"""
    rebalance_running: bool = True
    """rebalancing may also move running requests (stopped and resumed elsewhere with their generated prefix) where
    the engine can preempt"""
    rebalance_interval_s: float = Field(0.1, gt=0)
    """rebalancing checks progress at most this often"""

    # Elastic: the instance count, scaled live.
    elastic: bool = False
    """scale the instance count live: add one when generation lags training by at least what one more instance saves
    (PAPER.md 3.4), remove one when generation keeps outpacing training"""
    min_instances: int = Field(1, ge=1)
    """elastic: fewest instances"""
    max_instances: int | None = Field(None, ge=1)
    """elastic: most instances (default num_instances + 1); the placement reserves CPUs for this many"""
    scale_down_patience: int = Field(3, ge=1)
    """elastic: iterations in a row that generation must outpace training (with one instance fewer) before one is
    removed, and the iterations after any change before another removal"""
    scale_up_min_gain: float = Field(0.1, ge=0, lt=1)
    """elastic: add one only if it is predicted to save at least this fraction of the generation time"""
    scale_down_margin: float = Field(0.25, ge=0, lt=1)
    """elastic: remove one only if generation with one instance fewer is predicted at most (1 - margin) x the
    training time"""

    # Faults and heartbeats: hung or dead instances and their replacements.
    restart: bool = True
    """start a replacement (with the current weights) for an instance that died or stopped answering"""
    max_restarts: int = Field(8, ge=0)
    """replacements started over the whole run, at most"""
    heartbeat_timeout_s: float = Field(120.0, gt=0)
    """an instance that answers no call (poll, submit, weight update) for this long is taken as hung: killed, its
    requests re-dispatched"""
    replacement_timeout_s: float = Field(300.0, gt=0)
    """how long a replacement may take to start (Ray scheduling and model load) before it counts as failed"""

    # Engine and memory: the backend, the instances' resources and the continuous-batching cache.
    engine: Literal["transformers", "vllm"] = "transformers"
    """generation backend; vllm needs the vllm package (`make test-vllm` builds .venv-vllm)"""
    vllm: dict[str, Any] = Field(default_factory=dict)
    """extra VLLMEngine settings when engine=vllm: dtype, device, multiprocessing, enforce_eager,
    gpu_memory_utilization, engine_args"""
    num_instances: int = Field(1, ge=1)
    """generation instances (one Ray actor each)"""
    threads_per_instance: int = Field(1, ge=1)
    """CPUs (Ray num_cpus) of each generation instance"""
    cpus_per_instance: float | None = Field(None, gt=0)
    """Ray CPUs reserved per instance when not threads_per_instance (a fraction oversubscribes on purpose)"""
    resources: dict[str, float] = Field(default_factory=dict)
    """custom Ray resources per instance, e.g. {H20: 1}"""
    cb_attention: Literal["varlen", "dense"] = "varlen"
    """transformers engine on CPU: 'varlen' attends each request to its own keys (sgs/engines/varlen_attention.py);
    'dense' is transformers' packed masked attention"""
    prefix_cache: bool | None = None
    """reuse the KV blocks of a prefix already computed (a GRPO group's prompt, a trajectory's earlier turns on its
    instance); keys written before a weight update are never reused after it. None = on for vllm; on the transformers
    engine on for multi-turn rollouts (task.env or task.tools), off otherwise"""
    max_batch_tokens: int = Field(1024, ge=16)
    max_requests_per_batch: int = Field(64, ge=1)
    num_blocks: int = Field(512, ge=8)
    page_size: int = Field(32, ge=1)

    @field_validator("dispatch")
    @classmethod
    def _known_dispatch(cls, value: str) -> str:
        from streamrl.scheduling.dispatch import DISPATCH_POLICIES  # pure Python: no torch, no Ray

        return _choice(value, DISPATCH_POLICIES, "policy")

    @model_validator(mode="after")
    def _elastic_bounds(self) -> "GenerationConfig":
        """The live scaler's bounds (``scheduling.elastic.ElasticScaler``), checked before any work."""
        most = self.max_instances if self.max_instances is not None else self.num_instances + 1
        if self.elastic and self.min_instances > most:
            raise PydanticCustomError("streamrl_value", f"generation.elastic: generation.min_instances="
                                      f"{self.min_instances} is more than the most instances, {most} "
                                      "(generation.max_instances, default num_instances + 1)")
        return self

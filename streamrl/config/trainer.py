"""``trainer``: the RL algorithm, its optimizer, batching, backend and off-policy correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.base import _Section


class TrainerConfig(_Section):
    algo: Literal["grpo", "ppo"] = "grpo"
    """grpo (group-relative advantages) | ppo (with a critic)"""
    lr: float = Field(1e-4, gt=0)
    """policy learning rate"""
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    kl_coef: float = Field(0.0, ge=0)
    """KL to the frozen reference; 0 disables the reference"""
    grad_clip: float = Field(1.0, gt=0)
    micro_batch_tokens: int = Field(4096, ge=16)
    """token budget of one micro-batch"""
    activation_checkpointing: bool = False
    """keep only each transformer block's input and recompute the rest in backward (about a third more
    compute, a fraction of the activation memory; the single trainer)"""
    step_tokens: int = Field(0, ge=0)
    """dynamic batch: an optimizer step fires once finished groups (in completion order) hold this many tokens; 0 =
    one step per iteration"""
    epochs: int = Field(1, ge=1)
    """passes over each batch"""
    threads: int = Field(1, ge=1)
    """torch threads (and Ray CPUs) of the single trainer"""
    backend: Literal["single", "fsdp"] = "single"
    """single = one trainer process (the trainer actor); fsdp = FSDP2 ranks as Ray actors in one placement group,
    driven by the trainer actor (disaggregated modes, GRPO without KL; required on placement.device=cuda)"""
    fsdp_ranks: int = Field(2, ge=1)
    """FSDP2 world size on placement.device=cpu (gloo); on cuda it is placement.trainer_gpus"""
    fsdp_rank_cpus: float = Field(1.0, gt=0)
    """CPUs each FSDP2 rank reserves on placement.device=cpu (a fraction shares a core; torch threads per rank:
    max(1, int(this)))"""
    max_staleness: int | None = Field(None, ge=0)
    """versions a trained sample's oldest token may lag the trainer; None = the mode's (0, stream-async 1); above 1
    only in stream-async, where generation then runs up to k iterations ahead"""
    correction: Literal["none", "decoupled", "tis"] = "none"
    """off-policy correction of stale samples: none (PPO clip against the behaviour log-probs) | decoupled (AReaL's
    decoupled PPO: clip against the trainer's pre-step policy, weight by pre-step / behaviour) | tis (policy
    gradient weighted by truncated pi/behaviour per token)"""
    is_cap: float = Field(2.0, gt=0)
    """truncation of the importance weights (decoupled and tis)"""
    # PPO
    critic_lr: float = Field(5e-4, gt=0)
    """PPO critic learning rate"""
    vf_coef: float = Field(0.5, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, gt=0, le=1)
    """PPO discount"""
    lam: float = Field(0.95, ge=0, le=1)
    """PPO GAE lambda"""


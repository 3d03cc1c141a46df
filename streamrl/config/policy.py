"""``policy``: the checkpoint to train, and the tiny policy's architecture and warm start."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.base import _Section


class PolicyConfig(_Section):
    path: str = ".cache/tiny-policy"
    """a local Hugging Face causal-LM checkpoint directory, or a hub id already in the local Hugging Face cache
    (resolved offline)"""
    make_if_missing: bool = True
    """build the tiny policy when policy.path is a missing directory named tiny-policy* (its cache); any other
    missing path is an error"""
    save_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """dtype of the final policy checkpoint; auto = bfloat16 on cuda, float32 on cpu"""
    # Tiny-policy architecture (used by `streamrl make-policy`).
    hidden_size: int = Field(128, ge=16)
    """tiny policy: hidden size"""
    num_layers: int = Field(4, ge=1)
    """tiny policy: transformer layers"""
    num_heads: int = Field(4, ge=1)
    """tiny policy: attention heads (divides hidden_size)"""
    num_kv_heads: int = Field(2, ge=1)
    """tiny policy: key/value heads (divides num_heads)"""
    intermediate_size: int = Field(384, ge=16)
    """tiny policy: MLP width"""
    max_position_embeddings: int = Field(512, ge=64)
    """tiny policy: longest prompt + response"""
    # Supervised warm start.
    sft_steps: int = Field(1500, ge=0)
    """tiny policy: at most this many supervised warm-start steps"""
    sft_batch_size: int = Field(32, ge=1)
    """tiny policy: supervised warm-start batch size"""
    sft_lr: float = Field(2e-3, gt=0)
    """tiny policy: supervised warm-start learning rate"""
    sft_target_accuracy: float = Field(0.45, gt=0, le=1)
    """stop SFT once sampled accuracy reaches this"""

    @model_validator(mode="after")
    def _heads_divide(self) -> "PolicyConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"policy.hidden_size={self.hidden_size} is not divisible by policy.num_heads={self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"policy.num_heads={self.num_heads} is not divisible by policy.num_kv_heads={self.num_kv_heads}")
        return self


"""``trainer``: the RL algorithm, its optimizer, batching, backend and off-policy correction."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from streamrl.config.base import _Section

DAPO = {"clip_eps": 0.2, "clip_eps_high": 0.28, "loss_agg": "token-mean", "kl_coef": 0.0, "overlong": "penalty",
        "dynamic_sampling": True}
"""What ``trainer.preset: dapo`` sets (DAPO, Yu et al. 2025), field by field, where the config does not."""


class LoraConfig(_Section):
    """LoRA adapters trained with peft instead of every weight; only the adapters are published to the
    instances (a few MB per update), which merge them into their copy of the base weights."""

    rank: int = Field(0, ge=0)
    """adapter rank; 0 = off (full fine-tuning)"""
    alpha: float = Field(32.0, gt=0)
    """scaling numerator: the update is (alpha / rank) * B @ A"""
    dropout: float = Field(0.0, ge=0, lt=1)
    """dropout on the adapter's input while training"""
    target_modules: list[str] | None = None
    """names of the linear modules that get adapters (e.g. [q_proj, v_proj]); None = every linear layer of the
    transformer blocks (the attention and MLP projections), not the output head"""
    export_merged: bool = False
    """at the end of the run also write policy-merged/: the base model with the adapter merged in"""


class TrainerConfig(_Section):
    preset: Literal["none", "dapo"] = "none"
    """dapo = clip-higher 0.2/0.28, token-mean loss, no KL, overlong penalty, dynamic sampling; fields set
    explicitly win"""
    algo: Literal["grpo", "ppo"] = "grpo"
    """grpo (group-relative advantages) | ppo (with a critic)"""
    lr: float = Field(1e-4, gt=0)
    """policy learning rate"""
    weight_decay: float = Field(0.0, ge=0)
    clip_eps: float = Field(0.2, gt=0)
    """PPO clip: the ratio is clipped to [1 - clip_eps, 1 + clip_eps_high]"""
    clip_eps_high: float | None = Field(None, gt=0)
    """upper clip (DAPO's clip-higher, e.g. 0.28); None = clip_eps"""
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"] = "token-mean"
    """how per-token losses become the policy loss: token-mean (every token of the step weighs the same) |
    seq-mean-token-mean (each response's mean, averaged) | seq-mean-token-sum (each response's sum, averaged)"""
    kl_coef: float = Field(0.0, ge=0)
    """KL to the frozen reference; 0 disables the reference"""
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    """GRPO's KL-in-loss estimator (Schulman's k1 / k2 / k3); PPO puts k1 in the reward"""
    entropy_coef: float = Field(0.0, ge=0)
    """entropy bonus: the loss subtracts this times the token-mean entropy of the sampling distribution"""
    lr_warmup_steps: int = Field(0, ge=0)
    """optimizer steps of linear learning-rate warmup from 0"""
    lr_schedule: Literal["constant", "cosine"] = "constant"
    """after warmup: constant, or cosine decay to lr * lr_min_ratio at lr_decay_steps"""
    lr_decay_steps: int = Field(0, ge=0)
    """cosine: optimizer steps from the start to the end of the decay; 0 = run.iterations x epochs (one step per
    iteration)"""
    lr_min_ratio: float = Field(0.0, ge=0, le=1)
    """cosine: the final learning rate as a fraction of lr"""
    overlong: Literal["none", "filter", "penalty"] = "none"
    """responses cut at generation.max_new_tokens: none (trained as they are) | filter (no loss on them; they still
    count in their group's advantages) | penalty (DAPO's soft penalty over the last overlong_buffer tokens)"""
    overlong_buffer: int = Field(0, ge=0)
    """penalty: a response longer than max_new_tokens - overlong_buffer loses reward linearly, down to
    -overlong_penalty at max_new_tokens"""
    overlong_penalty: float = Field(1.0, ge=0)
    """penalty: the largest reward subtracted"""
    dynamic_sampling: bool = False
    """GRPO: a group whose rewards are all equal (no advantage, no gradient) is not trained on; the trainer counts
    them (train/zero_signal_groups) and the step's loss is over the groups that carry signal"""
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
    lora: LoraConfig = Field(default_factory=LoraConfig)
    """LoRA adapters (rank 0 = full fine-tuning)"""
    # PPO
    critic_lr: float = Field(5e-4, gt=0)
    """PPO critic learning rate"""
    vf_coef: float = Field(0.5, ge=0)
    vf_clip: float = Field(0.2, gt=0)
    gamma: float = Field(1.0, gt=0, le=1)
    """PPO discount"""
    lam: float = Field(0.95, ge=0, le=1)
    """PPO GAE lambda"""


    @model_validator(mode="before")
    @classmethod
    def _preset(cls, data):
        if isinstance(data, dict) and data.get("preset") == "dapo":
            data = {**DAPO, **data}
        return data

"""The Trainer: GRPO and PPO updates on the policy (plus optional reference and critic).

Dataflow inside one RL iteration (every mode uses the same calls)::

    samples (scored, from the SGS) --prepare()--> Prepared  (per-sample work, on arrival:
                                                  reference log-probs, critic values, GAE)
    groups of Prepared --------------train_step()--> one optimizer step (micro-batched by a
                                                  token budget, gradients accumulated)
    policy_state() / publish() ----------------------> weights for the engines (version + 1)

Invariant: prepared inputs do not depend on when a sample arrives in its iteration (stream-sync
and batch-sync train on identical inputs). ``Trainer`` lists the choices the papers leave open.
"""

from __future__ import annotations

import copy
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from streamrl.config import Config
from streamrl.models import lora
from streamrl.models.tiny import load_policy
from streamrl.models.logprobs import model_logprobs
from streamrl.trainer import losses
from streamrl.trainer.meta_init import enable_activation_checkpointing
from streamrl.trainer.schedule import lr_for_step, set_lr
from streamrl.types import Sample


@dataclass
class Prepared:
    """One sample ready to train on: tokens, masks and every per-sample tensor it needs."""

    input_ids: list[int]
    resp_start: int
    """Index in ``input_ids`` of the first response token."""
    old_logprobs: list[float]
    reward: float
    version: int
    prompt_id: str
    ref_logprobs: list[float] | None = None
    old_values: list[float] | None = None
    advantages: list[float] | None = None
    """Per response token (PPO: GAE; GRPO: the group advantage repeated)."""
    returns: list[float] | None = None
    prox_logprobs: list[float] | None = None
    """Decoupled PPO: the trainer's log-probs before the first optimizer step on this sample."""
    loss_mask: list[int] | None = None
    """Per response token: 0 where the policy did not sample it (a trajectory's environment and
    tool tokens); None = every response token is trained."""
    meta: dict = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_response_tokens(self) -> int:
        return len(self.input_ids) - self.resp_start

    @property
    def trained_tokens(self) -> int:
        """Response tokens the loss sees: none for a response ``trainer.overlong: filter`` drops."""
        return 0 if self.meta.get("filtered") else self.sampled_tokens

    @property
    def sampled_tokens(self) -> int:
        """Response tokens the policy sampled (all but a trajectory's environment tokens)."""
        return sum(self.loss_mask) if self.loss_mask is not None else self.num_response_tokens


class ValueModel(nn.Module):
    """Critic: the policy's transformer body with a scalar head, initialised from the policy."""

    def __init__(self, policy: nn.Module) -> None:
        super().__init__()
        self.body = copy.deepcopy(policy.model)
        self.head = nn.Linear(policy.config.hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids, attention_mask):
        hidden = self.body(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(hidden).squeeze(-1)


def _pad(items: list[Prepared], pad_id: int):
    """Token tensors for a micro-batch; ``mask`` marks target positions that are trained response
    tokens (a filtered overlong response's row stays 0)."""
    width = max(p.num_tokens for p in items)
    ids = torch.full((len(items), width), pad_id, dtype=torch.long)
    attn = torch.zeros((len(items), width), dtype=torch.long)
    mask = torch.zeros((len(items), width - 1))
    for i, p in enumerate(items):
        ids[i, : p.num_tokens] = torch.tensor(p.input_ids)
        attn[i, : p.num_tokens] = 1
        if p.trained_tokens:
            mask[i, p.resp_start - 1: p.num_tokens - 1] = 1.0 if p.loss_mask is None else torch.tensor(
                p.loss_mask, dtype=mask.dtype)
    return ids, attn, mask


def _per_token(items: list[Prepared], attr: str, width: int) -> torch.Tensor:
    """Scatter each item's per-response-token list into the [B, width-1] target layout."""
    out = torch.zeros((len(items), width - 1))
    for i, p in enumerate(items):
        values = getattr(p, attr)
        out[i, p.resp_start - 1: p.resp_start - 1 + len(values)] = torch.tensor(values)
    return out


def micro_batches(items: list[Prepared], token_budget: int) -> list[list[Prepared]]:
    """Split in order so each micro-batch's padded size (rows x longest) stays within the budget;
    a single sample longer than the budget still forms its own micro-batch."""
    out: list[list[Prepared]] = []
    cur: list[Prepared] = []
    longest = 0
    for p in items:
        new_longest = max(longest, p.num_tokens)
        if cur and new_longest * (len(cur) + 1) > token_budget:
            out.append(cur)
            cur, new_longest = [], p.num_tokens
        cur.append(p)
        longest = new_longest
    if cur:
        out.append(cur)
    return out


def to_prepared(s: Sample) -> Prepared:
    """The model-free part of preparing a sample: tokens, old log-probs, reward, version.

    The old-policy log-probs are the engine's sampled-token log-probs (weights W_i, temperature
    applied). They are exactly the behaviour policy, need no extra forward pass, and stay valid
    in stream-sync where the trainer may already have stepped before a late sample arrives. The
    engine and the trainer compute them with the same model code (parity is tested in the
    engine suite)."""
    c = s.completion
    if len(c.logprobs) != len(c.output_ids):
        raise ValueError(f"sample {c.request_id}: {len(c.logprobs)} logprobs for {len(c.output_ids)} tokens")
    if not c.output_ids:
        raise ValueError(f"sample {c.request_id} has an empty response")
    return Prepared(input_ids=list(c.prompt_ids) + list(c.output_ids), resp_start=len(c.prompt_ids),
                    old_logprobs=list(c.logprobs), reward=s.reward, version=c.version_start,
                    prompt_id=s.prompt.prompt_id, loss_mask=list(c.loss_mask) if c.loss_mask else None,
                    meta={"request_id": c.request_id, "truncated": c.finish_reason == "length"})


def prepare_samples(cfg: Config, groups: list[list[Sample]]) -> list[list[Prepared]]:
    """``to_prepared`` on every sample, then ``trainer.overlong``: a response cut at
    ``generation.max_new_tokens`` is filtered out of the loss (it still counts in its group's
    advantages), or its reward gets DAPO's soft penalty (``losses.overlong_penalty``; a buffer of
    0 means a fifth of ``max_new_tokens``). Then ``trainer.dynamic_sampling`` (GRPO): a group
    whose rewards are all equal is filtered out of the loss as a whole."""
    out = [[to_prepared(s) for s in g] for g in groups]
    t, cap = cfg.trainer, cfg.generation.max_new_tokens
    for p in (p for g in out for p in g):
        if t.overlong == "filter":
            p.meta["filtered"] = p.meta["truncated"]
        elif t.overlong == "penalty":
            p.reward += losses.overlong_penalty(p.sampled_tokens, cap, t.overlong_buffer or cap // 5,
                                                t.overlong_penalty)
    if t.dynamic_sampling and t.algo == "grpo":
        for g in out:
            if len({p.reward for p in g}) == 1:
                for p in g:
                    p.meta["filtered"] = p.meta["zero_signal"] = True
    return out


def filter_counts(items: list[Prepared]) -> dict[str, float]:
    """How many of a step's samples the loss does not see, and how many of those for zero signal."""
    return {"train/filtered_samples": sum(1 for p in items if p.meta.get("filtered")),
            "train/zero_signal_samples": sum(1 for p in items if p.meta.get("zero_signal"))}


def skipped_step(items: list[Prepared]) -> dict[str, float] | None:
    """The metrics of a step that is not taken because no sample carries a gradient (Adam would
    still move the weights on zero gradients), or None when the step is to be taken."""
    if any(p.trained_tokens for p in items):
        return None
    return {**filter_counts(items), "train/skipped_step": 1.0, "train/samples": len(items)}


def step_denominators(items: list[Prepared]) -> tuple[float, float]:
    """The whole optimizer step's trained tokens and trained sequences (every micro-batch's loss is
    divided by the step's count, so accumulated gradients equal the full-batch one)."""
    tokens = float(sum(p.trained_tokens for p in items))
    return max(tokens, 1.0), max(float(sum(1 for p in items if p.trained_tokens)), 1.0)


def policy_objective(tcfg, mb: list[Prepared], logp: torch.Tensor, mask: torch.Tensor,
                     denominator: float, sequences: float | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy term of one micro-batch under ``trainer.correction``: PPO clipped against the
    behaviour log-probs (``none``), decoupled PPO (``decoupled``: the proximal policy is this
    step's, captured on the sample's first step and kept for later epochs), or truncated IS
    (``tis``), aggregated by ``trainer.loss_agg`` (``denominator``: the step's tokens;
    ``sequences``: its sequences, for the seq-mean aggregations). Shared by the single trainer
    and the FSDP2 ranks."""
    agg = tcfg.loss_agg
    if agg != "token-mean":
        denominator = sequences if sequences is not None else float(sum(1 for p in mb if p.trained_tokens))
    kw = {"loss_agg": agg, "denominator": denominator}
    width = logp.shape[1] + 1
    behav = _per_token(mb, "old_logprobs", width).to(logp.device)
    adv = _per_token(mb, "advantages", width).to(logp.device)
    if tcfg.correction == "tis":
        return losses.tis_policy_loss(logp, behav, adv, mask, is_cap=tcfg.is_cap, **kw)
    if tcfg.correction == "decoupled":
        if all(p.prox_logprobs is not None for p in mb):
            prox = _per_token(mb, "prox_logprobs", width).to(logp.device)
        else:  # the weights before this step are the ones computing logp: pi_prox = logp, as a constant
            prox = logp.detach()
            for i, p in enumerate(mb):
                p.prox_logprobs = prox[i, p.resp_start - 1: p.num_tokens - 1].cpu().tolist()
        return losses.decoupled_policy_loss(logp, prox, behav, adv, mask, clip_eps=tcfg.clip_eps, is_cap=tcfg.is_cap,
                                            clip_eps_high=tcfg.clip_eps_high, **kw)
    return losses.policy_loss(logp, behav, adv, mask, clip_eps=tcfg.clip_eps, clip_eps_high=tcfg.clip_eps_high, **kw)


def set_group_advantages(groups: list[list[Prepared]]) -> None:
    """GRPO: each sample's advantage is its reward normalised within its group (population std)."""
    adv = losses.grpo_advantages([[p.reward for p in g] for g in groups])
    flat = [p for g in groups for p in g]
    for p, a in zip(flat, adv.tolist()):
        p.advantages = [a] * p.num_response_tokens


class Trainer:
    """Holds the policy, optimizer, and (when configured) reference and critic.

    Decisions the papers leave open, and ours:

    - *Old-policy log-probs* are the engine's (``to_prepared``).
    - *Values* (PPO) come from a snapshot of the critic taken at ``begin_iteration()``, so a
      sample prepared on arrival gets the same old values whether it arrives before or after a
      mini-batch step: stream-sync and batch-sync see identical inputs.
    - *KL*: GRPO puts k3 KL to the reference in the loss; PPO puts k1 KL in the per-token reward
      (InstructGPT style). Both off when ``trainer.kl_coef == 0`` (then no reference is loaded).
    - *Advantages*: GRPO normalises within each group (population std); PPO uses GAE per sample
      with no batch whitening, so a sample's advantage is final the moment it is prepared."""

    def __init__(self, cfg: Config, policy_path: str | None = None) -> None:
        self.cfg = cfg
        self.tcfg = cfg.trainer
        self._publisher = None  # weights.engine.WeightPublisher, made at the first publish (needs Ray)
        torch.set_num_threads(self.tcfg.threads)
        torch.manual_seed(cfg.run.seed)
        self.model, self.tokenizer = load_policy(policy_path or cfg.policy.path)
        self.model.train()
        if self.tcfg.activation_checkpointing:  # recompute each block's activations in backward
            enable_activation_checkpointing(self.model)
        self.pad_id = self.tokenizer.pad_token_id
        self.temperature = cfg.generation.temperature
        self.critic = self.critic_old = self.critic_opt = None
        if self.tcfg.algo == "ppo":  # the critic is a full model in both cases, copied from the base policy
            self.critic = ValueModel(self.model)
            self.critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=self.tcfg.critic_lr)
        self.lora = self.tcfg.lora.rank > 0
        if self.lora:  # peft freezes the base weights; the optimizer sees only the adapters
            self.model = lora.wrap(self.model, self.tcfg.lora)
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(trainable, lr=self.tcfg.lr, weight_decay=self.tcfg.weight_decay)
        # KL's reference: a frozen copy, or with LoRA the same weights with the adapter switched off
        self.ref = None
        self.use_ref = self.tcfg.kl_coef > 0
        if self.use_ref and not self.lora:
            self.ref = copy.deepcopy(self.model).eval().requires_grad_(False)
        self.version = 0
        self.steps = 0

    # ----------------------------------------------------------------- per-sample work (on arrival)
    def begin_iteration(self) -> None:
        """Snapshot what per-sample work must read as 'weights W_i' (the critic's old values)."""
        if self.critic is not None:
            self.critic_old = copy.deepcopy(self.critic).eval().requires_grad_(False)

    def prepare(self, samples: list[Sample]) -> list[Prepared]:
        """Per-sample work for one group (see ``prepare_groups``)."""
        return self.prepare_groups([samples])[0]

    @torch.no_grad()
    def prepare_groups(self, groups: list[list[Sample]]) -> list[list[Prepared]]:
        """Per-sample work: reference log-probs, old values and GAE (PPO). Pure function of the
        samples and the iteration-start snapshots, so arrival order does not matter.

        All samples of all ``groups`` share the forward passes: they are sorted by length and cut
        into micro-batches of ``micro_batch_tokens`` padded tokens, so a call with many short
        groups costs a few batched passes instead of one small pass per group, and a long sample
        does not pad the short ones."""
        out = prepare_samples(self.cfg, groups)
        if not self.use_ref and self.critic is None:
            return out
        if self.critic is not None and self.critic_old is None:
            self.begin_iteration()
        flat = sorted((p for g in out for p in g), key=lambda p: p.num_tokens)
        for mb in micro_batches(flat, self.tcfg.micro_batch_tokens):
            self._prepare_forward(mb)
        return out

    def _ref_logprobs(self, ids, attn) -> torch.Tensor:
        """The reference policy's log-probs: the frozen copy, or the base model under the adapters."""
        if not self.lora:
            return model_logprobs(self.ref, ids, attn, self.temperature)[0]
        was_training = self.model.training
        self.model.eval()  # no adapter dropout; the reference is deterministic
        try:
            with self.model.disable_adapter():
                return model_logprobs(self.model, ids, attn, self.temperature)[0]
        finally:
            self.model.train(was_training)

    def _prepare_forward(self, items: list[Prepared]) -> None:
        ids, attn, mask = _pad(items, self.pad_id)
        if self.use_ref:
            ref_lp = self._ref_logprobs(ids, attn)
            for i, p in enumerate(items):
                p.ref_logprobs = ref_lp[i, p.resp_start - 1: p.num_tokens - 1].tolist()
        if self.critic is not None:
            values = self.critic_old(ids, attn)[:, :-1] * mask
            rewards = torch.zeros_like(mask)
            for i, p in enumerate(items):
                rewards[i, p.num_tokens - 2] = p.reward
            if self.use_ref:
                ref = _per_token(items, "ref_logprobs", ids.shape[1])
                old = _per_token(items, "old_logprobs", ids.shape[1])
                rewards = rewards - self.tcfg.kl_coef * losses.kl_penalty(old, ref, mask, kind="k1")
            adv, ret = losses.gae(rewards, values, mask, gamma=self.tcfg.gamma, lam=self.tcfg.lam)
            for i, p in enumerate(items):
                sl = slice(p.resp_start - 1, p.num_tokens - 1)
                p.old_values, p.advantages, p.returns = values[i, sl].tolist(), adv[i, sl].tolist(), ret[i, sl].tolist()

    set_group_advantages = staticmethod(set_group_advantages)

    # ----------------------------------------------------------------------- one optimizer step
    def train_step(self, items: list[Prepared]) -> dict[str, float]:
        """One optimizer step on ``items`` (a PPO mini-batch), micro-batched by the token budget
        with gradient accumulation; the loss is the token mean over the whole mini-batch."""
        if not items:
            raise ValueError("train_step needs at least one sample")
        t0 = time.time()
        skipped = skipped_step(items)
        if skipped is not None:
            return skipped
        total_tokens, total_seqs = step_denominators(items)
        self.opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None:
            self.critic_opt.zero_grad(set_to_none=True)
        sums: dict[str, float] = {}
        for mb in micro_batches(items, self.tcfg.micro_batch_tokens):
            for key, value in self._micro_step(mb, total_tokens, total_seqs).items():
                sums[key] = sums.get(key, 0.0) + value * sum(p.trained_tokens for p in mb) / total_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.tcfg.grad_clip)
        set_lr(self.opt, lr_for_step(self.cfg, self.steps))
        self.opt.step()
        if self.critic_opt is not None:
            torch.nn.utils.clip_grad_norm_(self.critic.parameters(), self.tcfg.grad_clip)
            self.critic_opt.step()
        self.steps += 1
        sums.update({"train/lr": float(self.opt.param_groups[0]["lr"]), "train/grad_norm": float(grad_norm), "train/step_s": time.time() - t0,
                     "train/tokens": sum(p.num_tokens for p in items), "train/samples": len(items), **filter_counts(items)})
        return sums

    def _micro_step(self, mb: list[Prepared], total_tokens: float, total_seqs: float) -> dict[str, float]:
        ids, attn, mask = _pad(mb, self.pad_id)
        width = ids.shape[1]
        logp, entropy = model_logprobs(self.model, ids, attn, self.temperature)
        loss, m = policy_objective(self.tcfg, mb, logp, mask, total_tokens, total_seqs)
        metrics = {f"train/{k}": v for k, v in m.items()}
        metrics["train/entropy"] = float(losses.masked_mean(entropy.detach(), mask))
        if self.tcfg.entropy_coef > 0:  # the bonus: higher entropy lowers the loss
            loss = loss - self.tcfg.entropy_coef * (entropy * mask).sum() / total_tokens
        if self.use_ref and self.tcfg.algo == "grpo":
            ref = _per_token(mb, "ref_logprobs", width)
            kl = losses.kl_penalty(logp, ref, mask, kind=self.tcfg.kl_estimator)
            kl_loss = kl.sum() / total_tokens
            loss = loss + self.tcfg.kl_coef * kl_loss
            metrics["train/kl"] = float(kl.detach().sum() / mask.sum())
        metrics["train/pg_loss"] = float(loss.detach()) * total_tokens / max(float(mask.sum()), 1.0)
        if self.critic is not None:
            values = self.critic(ids, attn)[:, :-1]
            vloss, vm = losses.value_loss(values, _per_token(mb, "old_values", width), _per_token(mb, "returns", width),
                                          mask, clip=self.tcfg.vf_clip, denominator=total_tokens)
            loss = loss + self.tcfg.vf_coef * vloss
            metrics.update({f"critic/{k}": v for k, v in vm.items()})
        loss.backward()
        return metrics

    def train_iteration(self, groups: list[list[Prepared]]) -> dict[str, float]:
        """All optimizer steps of one iteration when every group is at hand (colocated mode):
        ``epochs`` passes over the dynamic batches that ``dynamic_batches`` cuts from the groups
        in order, i.e. exactly the steps the stream modes take as the groups arrive."""
        metrics: dict[str, float] = {}
        batches = dynamic_batches(groups, self.tcfg.step_tokens)
        for _ in range(self.tcfg.epochs):
            for batch in batches:
                metrics = self.train_step([p for g in batch for p in g])
        metrics["train/steps_in_iter"] = len(batches) * self.tcfg.epochs
        return metrics

    def finish_iteration(self) -> int:
        """Close the iteration: the policy becomes version + 1."""
        self.version += 1
        return self.version

    # ------------------------------------------------------------------------------ weights, state
    def plain_copy(self) -> nn.Module:
        """A copy of the policy for an engine in this process; with LoRA the base model alone (the
        engine merges each adapter version into it)."""
        if self.lora:
            return copy.deepcopy(self.model).unload()
        return copy.deepcopy(self.model)

    def policy_state(self) -> dict[str, torch.Tensor]:
        """What the engines install: the whole state dict, or with LoRA the adapter alone
        (``models.lora.adapter_tensors``)."""
        if self.lora:
            return {k: v.clone() for k, v in lora.adapter_tensors(self.model).items()}
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def publish(self):
        """The current policy flattened into one buffer (in ``weights.wire_dtype``, with a delta
        from the last version when ``weights.delta``) and put in the Ray object store
        (``streamrl.weights.engine``); returns its ``WeightHandle``. Needs Ray initialised."""
        if self._publisher is None:
            from streamrl.weights.engine import WeightPublisher

            w = self.cfg.weights
            self._publisher = WeightPublisher(self.cfg.wire_dtype(), w.delta, w.bucket_mb)
        state = lora.adapter_tensors(self.model) if self.lora else self.model.state_dict()
        return self._publisher.publish(state, self.version)

    def delta_fraction(self) -> float | None:
        """Bytes of the last published delta over a full copy (None before the second publish)."""
        return self._publisher.last_delta_fraction if self._publisher is not None else None

    def parameters_vector(self) -> np.ndarray:
        """Every parameter flattened and concatenated in ``parameters()`` order (tests compare
        backends with it)."""
        return torch.cat([p.detach().flatten() for p in self.model.parameters()]).numpy()

    def shutdown(self) -> None:
        """Nothing to release: the policy lives in this process (``FSDPTrainerGroup`` has ranks)."""

    def save_checkpoint(self, path: str | Path, extra: dict | None = None) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        state = {
            # with LoRA the adapters alone: the base weights are policy.path's, unchanged
            "model": lora.trainable_state(self.model) if self.lora else self.model.state_dict(),
            "opt": self.opt.state_dict(),
            "critic": self.critic.state_dict() if self.critic is not None else None,
            "critic_opt": self.critic_opt.state_dict() if self.critic_opt is not None else None,
            "version": self.version, "steps": self.steps,
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()},
            "extra": extra or {},
        }
        tmp = path / "trainer.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(path / "trainer.pt")
        self.model.save_pretrained(path / "policy")
        self.tokenizer.save_pretrained(path / "policy")

    def load_checkpoint(self, path: str | Path) -> dict:
        state = torch.load(Path(path) / "trainer.pt", weights_only=False)
        if state.get("sharded"):  # an FSDP2 run's: each rank's shards, read here without a process group
            from streamrl.trainer.sharded_ckpt import load_sharded

            load_sharded(self.model, self.opt, Path(path) / state["sharded"])
        else:
            if self.lora:
                lora.load_trainable_state(self.model, state["model"])
            else:
                self.model.load_state_dict(state["model"])
            self.opt.load_state_dict(state["opt"])
        if self.critic is not None:
            self.critic.load_state_dict(state["critic"])
            self.critic_opt.load_state_dict(state["critic_opt"])
        self.version, self.steps = state["version"], state["steps"]
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        return state["extra"]


def group_tokens(group: list[Prepared]) -> int:
    return sum(p.num_tokens for p in group)


def dynamic_batches(groups: list[list], step_tokens: int, tokens=group_tokens) -> list[list[list]]:
    """Cut groups, in the given (completion) order, into optimizer-step batches: a batch closes as
    soon as its groups hold ``step_tokens`` tokens (``tokens(group)`` counts them; default:
    ``Prepared`` groups); the remainder forms the last batch. ``step_tokens == 0`` gives one
    batch. Stream-sync applies the same rule online."""
    if step_tokens <= 0:
        return [list(groups)] if groups else []
    out, cur, total = [], [], 0
    for g in groups:
        cur.append(g)
        total += tokens(g)
        if total >= step_tokens:
            out.append(cur)
            cur, total = [], 0
    if cur:
        out.append(cur)
    return out

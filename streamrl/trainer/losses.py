"""RL loss math as pure torch functions: advantages, PPO/GRPO surrogate, KL, GAE, value loss.

Conventions (every function):
- Per-token tensors are padded ``[B, T]``; ``mask`` is a float ``[B, T]`` with 1 on response
  (trained) tokens and 0 on prompt/padding. Masked positions never contribute to a loss or metric.
- Losses are returned as values to *minimise* (the surrogate objective is negated).
- Metrics are returned as ``dict[str, float]`` with short keys; the caller namespaces them.
- Losses take ``denominator``: pass every micro-batch the whole minibatch's count and the summed
  micro-batch gradients equal the full-batch loss's gradient (``_aggregate`` has the contract).

No Ray, no models, no torch.distributed: everything here is testable on CPU with tiny tensors.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
LOSS_AGG_ALIASES = {"seq-mean": "seq-mean-token-mean"}
KL_KINDS = ("k1", "k2", "k3")


def _check_shapes(**tensors: Tensor) -> None:
    """Raise ValueError naming every shape unless all tensors share one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"shape mismatch: {shapes}")


def masked_entropy(logits: Tensor, mask: Tensor, temperature: float = 1.0) -> float:
    """Mean per-token entropy (nats) of the sampling distribution ``softmax(logits / T)`` over the
    masked positions; a diagnostic (no gradient): entropy collapse is the usual sign of an RL run
    that has stopped exploring."""
    with torch.no_grad():
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        ent = -(logp.exp() * logp).sum(-1)
        return float(masked_mean(ent, mask))


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (over all of them, or along ``dim``).

    An empty mask gives 0 rather than NaN (the count is clamped to at least 1).
    """
    _check_shapes(x=x, mask=mask)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp(min=1)
    return (x * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``x`` with the mean and *population* variance of its masked entries.

    Returns ``(x - mean) / sqrt(var + eps)`` (mean added back if ``shift_mean=False``), with
    masked-out positions set to 0 so padding stays inert.
    """
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    out = (x - mean) * torch.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return out * mask


def grpo_advantages(
    rewards: Tensor | Sequence[Sequence[float] | Tensor],
    eps: float = 1e-6,
    normalize_std: bool = True,
) -> Tensor:
    """Group-relative advantages: ``(r - mean_group) / (std_group + eps)``.

    ``rewards`` is a ``[G, n]`` tensor (G prompts, n samples each) and the result is ``[G, n]``;
    or a list of G groups of possibly different sizes, and the result is the flat concatenation
    ``[sum(n_g)]`` in group order. The std is the *population* std (``unbiased=False``), as in
    common GRPO implementations, so a group of 2 with rewards {0, 1} gets advantages {+1, -1}.
    ``normalize_std=False`` only centres (the Dr. GRPO variant). A group whose rewards are all
    equal (including a group of one) gets exactly zero advantage: it carries no signal.
    """
    if isinstance(rewards, Tensor):
        if rewards.dim() != 2:
            raise ValueError(f"rewards must be [G, n], got shape {tuple(rewards.shape)}")
        r = rewards.float() if not rewards.is_floating_point() else rewards
        centred = r - r.mean(dim=1, keepdim=True)
        if normalize_std:
            centred = centred / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
        # Exact zeros for constant groups, whatever float rounding the mean did.
        constant = (r == r[:, :1]).all(dim=1, keepdim=True)
        return torch.where(constant, torch.zeros_like(centred), centred)
    groups = [torch.as_tensor(g, dtype=torch.float32).flatten() for g in rewards]
    if not groups or any(g.numel() == 0 for g in groups):
        raise ValueError(f"need at least one non-empty group, got sizes {[g.numel() for g in groups]}")
    return torch.cat([grpo_advantages(g[None], eps, normalize_std)[0] for g in groups])


def _aggregate(per_token: Tensor, mask: Tensor, loss_agg: str, denominator: float | Tensor | None) -> Tensor:
    """Reduce ``[B, T]`` per-token losses to a scalar.

    ``token-mean``: every trained token of the batch weighs the same (DAPO); ``seq-mean-token-mean``
    (alias ``seq-mean``): each sequence's token mean, averaged over sequences (GRPO's paper);
    ``seq-mean-token-sum``: each sequence's token sum, averaged over sequences (Dr. GRPO-style,
    no length normalisation). Gradient-accumulation contract: ``policy_loss`` and ``value_loss``
    take ``denominator``. Split a minibatch into micro-batches and pass each the *whole
    minibatch's* count (tokens for ``"token-mean"``, sequences for the ``seq-mean-*`` ones); each micro-batch loss is then
    ``sum(its per-token or per-seq losses) / denominator``, so calling ``backward()`` on every
    micro-batch loss (with no further scaling) accumulates exactly the gradient of the
    full-batch loss. Leaving ``denominator=None`` normalises by the micro-batch's own count,
    which is only equivalent when every micro-batch has the same count."""
    loss_agg = LOSS_AGG_ALIASES.get(loss_agg, loss_agg)
    if loss_agg == "token-mean":
        total = (per_token * mask).sum()
        default = mask.sum()
    elif loss_agg in ("seq-mean-token-mean", "seq-mean-token-sum"):
        tokens = mask.sum(dim=1)
        per_seq = (per_token * mask).sum(dim=1)
        total = (per_seq / tokens.clamp(min=1) if loss_agg == "seq-mean-token-mean" else per_seq).sum()
        default = (tokens > 0).sum()  # sequences with no trained tokens are not counted
    else:
        raise ValueError(f"unknown loss_agg {loss_agg!r}; expected one of {LOSS_AGGS}")
    if denominator is None:
        return total / default.clamp(min=1)
    if float(denominator) <= 0:
        raise ValueError(f"denominator must be > 0, got {float(denominator)}")
    return total / denominator


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    loss_agg: str = "token-mean",
    denominator: float | Tensor | None = None,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """PPO clipped surrogate loss (the policy term of PPO and GRPO).

    Shapes: ``logprobs``, ``old_logprobs``, ``mask`` are ``[B, T]``; ``advantages`` is ``[B]``
    (one per sequence, broadcast over tokens, as in GRPO) or ``[B, T]`` (per token, as from GAE).
    Per token, with ``ratio = exp(logprobs - old_logprobs)``::

        loss_t = -min(ratio * A, clip(ratio, 1 - clip_eps, 1 + clip_eps_high) * A)

    ``clip_eps_high`` defaults to ``clip_eps`` (set it higher for DAPO's clip-higher). When the
    clipped branch is the minimum, the token's gradient is zero. ``old_logprobs`` and
    ``advantages`` are treated as constants (detached).

    Aggregation: ``"token-mean"`` sums over all masked tokens of the batch and divides by the token
    count; ``"seq-mean"`` averages each sequence over its tokens, then averages sequences.
    ``denominator`` overrides the count for gradient accumulation (``_aggregate``).

    Metrics (over this call's masked tokens): ``clip_frac`` (fraction of tokens where clipping is
    active, i.e. zero gradient), ``approx_kl`` (mean of ``old_logprobs - logprobs``, the k1
    estimate of KL(old || new) from samples of old), ``ratio_mean``.
    """
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(
                f"advantages {tuple(advantages.shape)} does not match the batch of "
                f"logprobs {tuple(logprobs.shape)}"
            )
        advantages = advantages[:, None].expand_as(logprobs)
    _check_shapes(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    adv = advantages.detach()
    log_ratio = logprobs - old_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    per_token = torch.maximum(unclipped, clipped)
    loss = _aggregate(per_token, mask, loss_agg, denominator)
    with torch.no_grad():
        metrics = {
            "clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
            "approx_kl": masked_mean(-log_ratio, mask).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
        }
    return loss, metrics


def _expand_advantages(advantages: Tensor, logprobs: Tensor) -> Tensor:
    if advantages.dim() == 1:
        if advantages.shape[0] != logprobs.shape[0]:
            raise ValueError(f"advantages {tuple(advantages.shape)} does not match the batch of "
                             f"logprobs {tuple(logprobs.shape)}")
        return advantages[:, None].expand_as(logprobs)
    return advantages


def _weight_metrics(weights: Tensor, capped: Tensor, mask: Tensor) -> dict[str, float]:
    """Spread of per-token importance weights over the masked tokens, and the capped fraction."""
    w = weights[mask > 0]
    if w.numel() == 0:
        return {"is_weight_mean": 1.0, "is_weight_std": 0.0, "is_weight_max": 1.0, "is_weight_min": 1.0,
                "is_capped_frac": 0.0}
    return {"is_weight_mean": w.mean().item(), "is_weight_std": w.std(unbiased=False).item(),
            "is_weight_max": w.max().item(), "is_weight_min": w.min().item(),
            "is_capped_frac": masked_mean(capped.float(), mask).item()}


def decoupled_policy_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    is_cap: float = 2.0,
    loss_agg: str = "token-mean",
    denominator: float | Tensor | None = None,
    clip_eps_high: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Decoupled PPO (AReaL, Fu et al. 2025): the trust region is around the *proximal* policy
    (``prox_logprobs``: the trainer's policy before this update), and the behaviour policy that
    sampled the tokens (``behav_logprobs``, possibly several versions old) enters only through an
    importance weight. Per token, with ``r = exp(logprobs - prox)`` and
    ``w = min(exp(prox - behav), is_cap)``::

        loss_t = -w * min(r * A, clip(r, 1 - clip_eps, 1 + clip_eps) * A)

    ``w``, ``prox`` and ``behav`` are constants. With fresh samples (behav == prox) it is PPO's
    clipped loss. Truncating ``w`` at ``is_cap`` bounds the variance a very stale token can add
    (AReaL masks such tokens out instead). Metrics: ``clip_frac``, ``approx_kl`` (to prox) and the
    weights' spread (``is_weight_*``, ``is_capped_frac``)."""
    advantages = _expand_advantages(advantages, logprobs)
    _check_shapes(logprobs=logprobs, prox=prox_logprobs, behav=behav_logprobs, advantages=advantages, mask=mask)
    adv = advantages.detach()
    raw = torch.exp(prox_logprobs.detach() - behav_logprobs.detach())
    weight = torch.clamp(raw, max=is_cap)
    log_ratio = logprobs - prox_logprobs.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -ratio * adv
    high = clip_eps if clip_eps_high is None else clip_eps_high  # clip-higher, as in policy_loss
    clipped = -torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high) * adv
    per_token = weight * torch.maximum(unclipped, clipped)
    loss = _aggregate(per_token, mask, loss_agg, denominator)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((clipped > unclipped).float(), mask).item(),
                   "approx_kl": masked_mean(-log_ratio, mask).item(), "ratio_mean": masked_mean(ratio, mask).item(),
                   **_weight_metrics(raw, raw > is_cap, mask)}
    return loss, metrics


def tis_policy_loss(
    logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    is_cap: float = 2.0,
    loss_agg: str = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Truncated importance sampling on the behaviour log-probs (IMPALA's truncated policy
    gradient): per token, ``rho = min(exp(logprobs - behav), is_cap)`` as a constant, and::

        loss_t = -rho * A * logprobs

    whose gradient is ``-rho * A * grad log pi``: the on-policy policy gradient re-weighted to the
    current policy, with the weight truncated so no token's step is more than ``is_cap`` times its
    on-policy one. No clipping: ``clip_frac`` is the truncated fraction. Metrics: ``approx_kl``
    (behaviour to current) and the weights' spread."""
    advantages = _expand_advantages(advantages, logprobs)
    _check_shapes(logprobs=logprobs, behav=behav_logprobs, advantages=advantages, mask=mask)
    log_ratio = logprobs.detach() - behav_logprobs.detach()
    raw = torch.exp(log_ratio)
    rho = torch.clamp(raw, max=is_cap)
    per_token = -rho * advantages.detach() * logprobs
    loss = _aggregate(per_token, mask, loss_agg, denominator)
    with torch.no_grad():
        metrics = {"clip_frac": masked_mean((raw > is_cap).float(), mask).item(),
                   "approx_kl": masked_mean(-log_ratio, mask).item(), "ratio_mean": masked_mean(raw, mask).item(),
                   **_weight_metrics(raw, raw > is_cap, mask)}
    return loss, metrics


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, kind: str = "k3") -> Tensor:
    """Per-token estimates of KL(pi || ref) from tokens sampled from pi; ``[B, T]`` in and out.

    With ``log_r = ref_logprobs - logprobs`` (Schulman, "Approximating KL Divergence", 2020):
    ``k1 = -log_r`` (unbiased, high variance, can be negative); ``k2 = log_r**2 / 2`` (biased,
    low variance); ``k3 = exp(log_r) - 1 - log_r`` (unbiased, always >= 0; the GRPO default).
    ``log_r`` is clamped to [-20, 20] for k3 so a single outlier token cannot produce inf.
    Masked positions are 0. Gradients flow to both inputs; detach ``ref_logprobs`` upstream.
    """
    _check_shapes(logprobs=logprobs, ref_logprobs=ref_logprobs, mask=mask)
    log_r = ref_logprobs - logprobs
    if kind == "k1":
        kl = -log_r
    elif kind == "k2":
        kl = 0.5 * log_r**2
    elif kind == "k3":
        log_r = log_r.clamp(-20.0, 20.0)
        kl = torch.exp(log_r) - 1.0 - log_r
    else:
        raise ValueError(f"unknown KL kind {kind!r}; expected one of {KL_KINDS}")
    return kl * mask


@torch.no_grad()
def gae(
    rewards_token: Tensor, values: Tensor, mask: Tensor, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation over response tokens; returns ``(advantages, returns)``.

    All tensors are ``[B, T]``. ``rewards_token`` holds per-token rewards (typically the sequence
    reward on the last response token, optionally minus a per-token KL penalty); ``values`` holds
    the critic's value of each token's state. Going backwards over the *masked* tokens only::

        delta_t = r_t + gamma * V_next - V_t;   A_t = delta_t + gamma * lam * A_next

    where "next" is the next token with mask 1, and ``V_next = A_next = 0`` after the last one
    (the episode ends; nothing is bootstrapped from padding). Tokens with mask 0 inside a response
    (e.g. tool output in multi-turn) are skipped, not treated as ends. ``returns = A + V`` (the
    value-loss target). Both outputs are 0 on masked positions, detached, and not whitened (call
    ``masked_whiten`` on the advantages if wanted). A nonzero reward on a masked position is a bug
    upstream and raises.
    """
    _check_shapes(rewards_token=rewards_token, values=values, mask=mask)
    if rewards_token.dim() != 2:
        raise ValueError(f"expected [B, T] tensors, got shape {tuple(rewards_token.shape)}")
    if ((rewards_token != 0) & (mask == 0)).any():
        raise ValueError("rewards_token has nonzero rewards on masked (mask == 0) positions")
    m = mask.to(values.dtype)
    batch, length = values.shape
    advantages = torch.zeros_like(values)
    next_value = values.new_zeros(batch)
    next_adv = values.new_zeros(batch)
    for t in reversed(range(length)):
        delta = rewards_token[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam * next_adv
        # Masked tokens carry the "next" state through unchanged.
        next_adv = torch.where(m[:, t] > 0, adv_t, next_adv)
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        advantages[:, t] = adv_t * m[:, t]
    returns = (advantages + values) * m
    return advantages, returns


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip: float = 0.2,
    loss_agg: str = "token-mean",
    denominator: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped value loss: ``0.5 * max((V - R)^2, (V_clip - R)^2)``, token-mean by default.

    All tensors ``[B, T]``. ``V_clip = old_values + clamp(values - old_values, -clip, clip)``;
    ``old_values`` and ``returns`` are constants (detached). Aggregation and ``denominator`` as in
    ``policy_loss``. Metrics: ``vf_clip_frac`` (fraction of tokens where the clipped error is the
    larger, giving zero gradient), ``value_mean``, ``value_error`` (masked mean of (V - R)^2).
    """
    _check_shapes(values=values, old_values=old_values, returns=returns, mask=mask)
    old_values, returns = old_values.detach(), returns.detach()
    v_clipped = old_values + torch.clamp(values - old_values, -clip, clip)
    err = (values - returns) ** 2
    err_clipped = (v_clipped - returns) ** 2
    per_token = 0.5 * torch.maximum(err, err_clipped)
    loss = _aggregate(per_token, mask, loss_agg, denominator)
    with torch.no_grad():
        metrics = {
            "vf_clip_frac": masked_mean((err_clipped > err).float(), mask).item(),
            "value_mean": masked_mean(values, mask).item(),
            "value_error": masked_mean(err, mask).item(),
        }
    return loss, metrics


def overlong_penalty(length: int, max_len: int, buffer: int, penalty: float = 1.0) -> float:
    """DAPO's soft overlong punishment: 0 up to ``max_len - buffer`` tokens, then falling linearly
    to ``-penalty`` at ``max_len`` (and beyond). ``buffer`` 0 punishes only a response at the cap."""
    if length >= max_len:
        return -penalty
    start = max_len - buffer
    return 0.0 if length <= start else -penalty * (length - start) / buffer

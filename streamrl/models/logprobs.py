"""Per-token log-probabilities of a causal LM's targets: what the trainer's loss, the reference
and the ranker's re-scoring all compute, memory-bounded.

``token_logprobs`` starts from logits. ``head_logprobs`` starts one step earlier, from the last
hidden states and the LM head's weight, and never builds the ``[tokens, vocabulary]`` logits at all:
each chunk of rows is projected, reduced to its log-prob and entropy, and dropped; backward
recomputes it. On a 49K-token vocabulary that is the difference between gigabytes and a few hundred
MB per micro-batch. ``model_logprobs`` picks the head path for a Hugging Face causal LM whose logits
are a plain projection. Gradients are checked in tests/trainer/test_losses.py.
"""

from __future__ import annotations

import torch
from torch import Tensor


class _TokenLogProb(torch.autograd.Function):
    """log_softmax(logits / T)[target] over ``[N, V]`` rows, chunked in forward and backward.

    Saves only the input logits and a per-row logsumexp ``[N]``; backward recomputes the softmax
    one chunk at a time, so no ``[N, V]`` float tensor is ever kept alive.
    """

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk: int) -> Tensor:
        n = logits.shape[0]
        out = logits.new_empty(n, dtype=torch.float32)
        lse = logits.new_empty(n, dtype=torch.float32)
        for s in range(0, n, chunk):
            x = logits[s : s + chunk].float() / temperature
            lse[s : s + chunk] = torch.logsumexp(x, dim=-1)
            picked = x.gather(1, targets[s : s + chunk, None]).squeeze(1)
            out[s : s + chunk] = picked - lse[s : s + chunk]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        logits, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad = torch.empty_like(logits)
        for s in range(0, logits.shape[0], chunk):
            g = grad_out[s : s + chunk, None].float()
            probs = torch.exp(logits[s : s + chunk].float() / temperature - lse[s : s + chunk, None])
            # d/dx [x_y - logsumexp(x)] = onehot(y) - softmax(x), then chain through x = z / T.
            g_chunk = (-probs * g).scatter_add_(1, targets[s : s + chunk, None], g)
            grad[s : s + chunk] = (g_chunk / temperature).to(logits.dtype)
        return grad, None, None, None


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """Log-probabilities of ``targets`` under ``softmax(logits / temperature)``; float32 ``[B, T]``.

    ``logits`` is ``[B, T, V]`` (any float dtype) and ``targets`` ``[B, T]`` int64 with
    ``targets[b, t]`` the token scored by ``logits[b, t]`` (shift by one upstream: logits at t
    predict token t+1). Use the sampler's temperature so logprobs match the generator's. Memory:
    rows are processed ``chunk_size`` at a time in float32, and backward recomputes the softmax
    per chunk, so peak extra memory is ``O(chunk_size * V)`` instead of a full ``[B, T, V]``
    float copy. Supports first-order gradients only.
    """
    if logits.dim() != 3 or tuple(targets.shape) != tuple(logits.shape[:2]):
        raise ValueError(
            f"expected logits [B, T, V] and targets [B, T], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = logits.shape[-1]
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        lo, hi = targets.min().item(), targets.max().item()
        raise ValueError(f"targets out of range [0, {vocab}): min {lo}, max {hi}")
    flat = _TokenLogProb.apply(
        logits.reshape(-1, vocab), targets.reshape(-1).long(), float(temperature), chunk_size
    )
    return flat.view(targets.shape)


def _acc(t: Tensor) -> torch.dtype:
    """Accumulation dtype: float32, or float64 for float64 inputs (gradcheck)."""
    return torch.promote_types(t.dtype, torch.float32)


def _head_chunk(hidden: Tensor, weight: Tensor, bias: Tensor | None, temperature: float) -> Tensor:
    acc = _acc(hidden)
    z = hidden.to(acc) @ weight.to(acc).t()
    if bias is not None:
        z = z + bias.to(acc)
    return z / temperature


class _HeadLogProb(torch.autograd.Function):
    """``log_softmax((h W^T + b) / T)[target]`` and the entropy of that distribution, per row of
    ``h`` ``[N, H]``, chunk by chunk; saves only ``h``, the per-row logsumexp and entropy."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature: float, chunk: int):
        n, acc = hidden.shape[0], _acc(hidden)
        logp, lse, ent = (hidden.new_empty(n, dtype=acc) for _ in range(3))
        for s in range(0, n, chunk):
            z = _head_chunk(hidden[s : s + chunk], weight, bias, temperature)
            lse_c = torch.logsumexp(z, dim=-1)
            logp[s : s + chunk] = z.gather(1, targets[s : s + chunk, None]).squeeze(1) - lse_c
            z -= lse_c[:, None]  # z is now log p
            ent[s : s + chunk] = -(z.exp() * z).sum(-1)
            lse[s : s + chunk] = lse_c
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(targets)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp, grad_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        grad_h = torch.empty_like(hidden)
        acc = _acc(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=acc, device=bias.device)
        w = weight.to(acc)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(acc)
            logp_all = _head_chunk(h, weight, bias, temperature) - lse[s : s + chunk, None]
            probs = logp_all.exp()
            g_z = torch.zeros_like(probs)
            if grad_logp is not None:  # d/dz [z_y - lse(z)] = onehot(y) - p
                g = grad_logp[s : s + chunk, None].to(acc)
                g_z = (-probs * g).scatter_add_(1, targets[s : s + chunk, None], g)
            if grad_ent is not None:  # dH/dz_j = -p_j (log p_j + H)
                g_z -= grad_ent[s : s + chunk, None].to(acc) * probs * (logp_all + ent[s : s + chunk, None])
            g_z /= temperature
            grad_h[s : s + chunk] = (g_z @ w).to(hidden.dtype)
            grad_w += g_z.t() @ h
            if grad_b is not None:
                grad_b += g_z.sum(0)
        return (grad_h, grad_w.to(weight.dtype), None if grad_b is None else grad_b.to(bias.dtype), None, None, None)


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                  bias: Tensor | None = None, chunk_elements: int = 1 << 24) -> tuple[Tensor, Tensor]:
    """Log-probs of ``targets`` and per-position entropies (nats) under ``softmax((hidden W^T + b) / T)``,
    both float32 ``[B, T]`` and both differentiable (the entropy for an entropy bonus).

    ``hidden`` is ``[B, T, H]`` (the LM's last hidden states, already shifted so position t scores
    ``targets[:, t]``), ``weight`` the head's ``[V, H]``. Rows are processed so one chunk holds at
    most ``chunk_elements`` logits in float32 (64 MB by default); nothing ``[B*T, V]`` is kept."""
    if hidden.dim() != 3 or tuple(targets.shape) != tuple(hidden.shape[:2]):
        raise ValueError(f"expected hidden [B, T, H] and targets [B, T], got {tuple(hidden.shape)} and "
                         f"{tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    vocab = weight.shape[0]
    if targets.numel() and (targets.min() < 0 or targets.max() >= vocab):
        raise ValueError(f"targets out of range [0, {vocab}): min {targets.min().item()}, max {targets.max().item()}")
    chunk = max(1, chunk_elements // vocab)
    logp, ent = _HeadLogProb.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, targets.reshape(-1).long(),
                                   float(temperature), chunk)
    return logp.view(targets.shape), ent.view(targets.shape)


def plain_head(model) -> "torch.nn.Linear | None":
    """The LM head of a Hugging Face causal LM whose logits are exactly ``head(last_hidden)``
    (no softcapping or logit scale), else None (then callers take the full-logits path)."""
    cfg = getattr(model, "config", None)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if not isinstance(head, torch.nn.Linear) or cfg is None or not hasattr(model, "base_model"):
        return None
    if any(getattr(cfg, k, None) not in (None, 1.0) for k in ("final_logit_softcapping", "logit_scale", "logits_scaling")):
        return None
    return head


def model_logprobs(model, input_ids: Tensor, attention_mask: Tensor, temperature: float = 1.0
                   ) -> tuple[Tensor, Tensor]:
    """Per-token log-probs of ``input_ids[:, 1:]`` and the entropies at those positions, ``[B, T-1]``
    each, from a causal LM: through ``head_logprobs`` when the model has a plain head, else from
    its full logits (entropy then without a gradient)."""
    targets = input_ids[:, 1:]
    if hasattr(model, "get_base_model"):  # a peft model: the causal LM with its adapter layers in place
        model = model.get_base_model()
    head = plain_head(model)
    if head is not None:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return head_logprobs(hidden[:, :-1], head.weight, targets, temperature, bias=head.bias)
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    logp = token_logprobs(logits, targets, temperature=temperature)
    with torch.no_grad():
        lp = torch.log_softmax(logits.float() / temperature, dim=-1)
        ent = -(lp.exp() * lp).sum(-1)
    return logp, ent

"""Per-token log-probabilities of a causal LM's targets: what the trainer's loss, the reference
and the ranker's re-scoring all compute from logits, in one memory-bounded function.

No model, no Ray: a pure torch function (its gradient is checked in tests/trainer/test_losses.py).
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

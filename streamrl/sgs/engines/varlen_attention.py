"""Per-request (varlen) attention for transformers' continuous batching on CPU.

Without flash attention, continuous batching (CB) runs ``paged|eager``: every running request's
new tokens packed into one query sequence, every request's cached tokens into one key sequence,
multiplied densely under a block-diagonal mask. A decode step with B running requests of context
c then costs B x (B x c) query-key products, almost all masked away, and a request's cost depends
on the contexts of the others in its batch (docs/experiments.md). Flash and paged kernels on a
GPU (and vLLM) attend each request to its own keys only; ``varlen_paged_attention`` does so here.

Invariants: the same cache update and the same softmax over the same keys as transformers' own
functions (docs/results.md compares log-probs); only layers ``install`` marked, called with CB's
paged cache, take this path; every other call reaches transformers' original function unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn import functional as F

_installed = False
VARLEN_FLAG = "_streamrl_varlen"  # set on the attention layers of engines that use this path
SPLIT_MIN_KEYS = 1024  # decode buckets: split off the shorter requests only if that pads this many keys fewer


@dataclass
class _Plan:
    """Index tensors of one CB step; every layer of the step reuses them."""

    decode: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    # one entry per bucket of decoding requests: (packed query row of each, [B_b, max_k_b] packed
    # key index with clamped padding, [B_b, 1, 1, max_k_b] True where the key is the request's own)
    prefill: list[tuple[slice, slice, torch.Tensor]]  # (query rows, key rows, causal mask)


_last_plan: tuple[tuple, _Plan] | None = None


def _plan(cu_seq_q: torch.Tensor, cu_seq_k: torch.Tensor, n_keys: int) -> _Plan:
    global _last_plan
    cu_q, cu_k = cu_seq_q.tolist(), cu_seq_k.tolist()
    sig = (tuple(cu_q), tuple(cu_k), n_keys)
    if _last_plan is not None and _last_plan[0] == sig:
        return _last_plan[1]
    decode, prefill = [], []
    for i in range(len(cu_q) - 1):
        n_q, n_k = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if n_q == 1:
            decode.append(i)
        elif n_q > 1:
            mask = torch.ones(n_q, n_k, dtype=torch.bool).tril_(n_k - n_q)
            prefill.append((slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1]), mask))
    buckets = []
    if decode:
        lens_of = {i: cu_k[i + 1] - cu_k[i] for i in decode}
        order = sorted(decode, key=lambda i: -lens_of[i])
        start = 0
        while start < len(order):
            end, head = start + 1, lens_of[order[start]]
            # a new bucket only where it saves SPLIT_MIN_KEYS padded keys or more: each bucket
            # costs a few more small ops per layer, which short contexts do not repay
            while end < len(order) and (head - lens_of[order[end]]) * (len(order) - end) < SPLIT_MIN_KEYS:
                end += 1
            idx = order[start:end]
            starts = torch.tensor([cu_k[i] for i in idx])
            lens = torch.tensor([lens_of[i] for i in idx])
            ar = torch.arange(int(lens[0]))
            keys = (starts[:, None] + ar).clamp(max=n_keys - 1)
            mask = (ar[None, :] < lens[:, None])[:, None, None, :]
            buckets.append((torch.tensor([cu_q[i] for i in idx]), keys, mask))
            start = end
    plan = _Plan(buckets, prefill)
    _last_plan = (sig, plan)
    return plan


@torch.compiler.disable
def varlen_paged_attention(module, query, key, value, attention_mask, scaling, **kwargs):
    """Attention of CB's packed batch, each request attending only to its own keys.

    It has the signature of transformers' attention functions and does the same cache update,
    then attends each request to its own keys (from ``cu_seq_lens_q`` / ``cu_seq_lens_k``): the
    decoding requests (one new token each) are sorted by context length and cut into buckets, a
    cut wherever it pads ``SPLIT_MIN_KEYS`` keys fewer; each bucket shares one SDPA over its keys
    padded to its longest, ``[B_b, heads, 1, max_k_b]``; a request in prefill (a chunk of q new
    tokens, k keys) gets its own causal SDPA where query t sees keys ``j <= k - q + t``, so a
    prefill chunk never pads the decoders' queries. Cost: about sum(k) over the decoders plus
    sum(q x k) over prefill chunks, instead of (sum q) x (sum k). Buckets, because one bucket
    padded to the longest makes one long request cost like all of them long, and a bucket per
    length adds small ops per layer that cost more than they save. The outputs go back into the
    packed layout CB expects.

    ``query``: [1, heads, Nq, d] (packed new tokens); ``key``/``value``: [1, kv_heads, Nq, d]
    before the cache update. Returns ``([1, Nq, heads, d], None)`` like transformers' functions."""
    cache = kwargs.pop("cache", None)
    if cache is None:
        raise ValueError("varlen_paged_attention needs continuous batching's paged cache (kwargs['cache'])")
    key, value = cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    plan = _plan(kwargs["cu_seq_lens_q"], kwargs["cu_seq_lens_k"], key.shape[2])
    heads, kv_heads, d = query.shape[1], key.shape[1], query.shape[3]
    gqa = heads != kv_heads
    q_all, k_all, v_all = query[0], key[0], value[0]  # [heads, N, d]
    # CB's cache hands keys as a [kv_heads, N, d] view of a contiguous [N, kv_heads, d] tensor:
    # gathering rows of the latter is one contiguous index_select
    k_rows, v_rows = k_all.transpose(0, 1), v_all.transpose(0, 1)
    packed = q_all.new_zeros((q_all.shape[1], heads, d))  # [Nq, heads, d]
    for rows, keys, mask in plan.decode:
        # Decoding requests (one new token each), a bucket of similar contexts at a time: one
        # batched SDPA over keys padded to the bucket's longest. The query heads that share a KV
        # head are that head's query rows ([B_b, kv_heads, heads / kv_heads, d]; head h reads KV
        # head h // group, as transformers' repeat_kv): no copy of K and V per query head.
        n, max_k = keys.shape
        q = q_all[:, rows].transpose(0, 1).reshape(n, kv_heads, heads // kv_heads, d)
        k = k_rows.index_select(0, keys.reshape(-1)).view(n, max_k, kv_heads, d).transpose(1, 2)
        v = v_rows.index_select(0, keys.reshape(-1)).view(n, max_k, kv_heads, d).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)  # [B_b, kv, group, d]
        packed[rows] = out.reshape(n, heads, d)
    for qs, ks, mask in plan.prefill:
        # Prefill chunks: each request alone, causal with its past as offset (few per step).
        out = F.scaled_dot_product_attention(q_all[None, :, qs], k_all[None, :, ks], v_all[None, :, ks],
                                             attn_mask=mask, scale=scaling, enable_gqa=gqa)
        packed[qs] = out[0].transpose(0, 1)
    return packed.unsqueeze(0), None


def _routed(original):
    """``original`` for standard forwards and special layers; varlen for CB's paged-cache calls.

    Standard forwards (the colocated trainer's, on its own model copy), layers of engines built
    with ``attention="dense"`` (not marked) and layers with attention sinks or a sliding window
    reach transformers' original function."""
    from transformers.generation.continuous_batching.cache import PagedAttentionCache

    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        special = hasattr(module, "sinks") or getattr(module, "sliding_window", None)
        opted_in = getattr(module, VARLEN_FLAG, False)
        if special or not opted_in or not isinstance(kwargs.get("cache"), PagedAttentionCache):
            return original(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        return varlen_paged_attention(module, query, key, value, attention_mask, scaling, **kwargs)

    return attention


def install(model) -> None:
    """Route ``model``'s CB attention (``sdpa``, the tiny policy's default, and ``paged|eager``)
    through ``varlen_paged_attention``: mark its attention layers, and (once per process) wrap
    the two entries of transformers' process-wide attention registry so marked layers with a
    paged cache take the varlen path (``_routed``)."""
    global _installed
    for module in model.modules():
        if hasattr(module, "layer_idx") and hasattr(module, "q_proj"):
            setattr(module, VARLEN_FLAG, True)
    if _installed:
        return
    from transformers import AttentionInterface
    from transformers.integrations.eager_paged import eager_paged_attention_forward
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register("sdpa", _routed(sdpa_attention_forward))
    AttentionInterface.register("paged|eager", _routed(eager_paged_attention_forward))
    _installed = True

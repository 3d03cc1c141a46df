"""Generation cost measurements: decode latency vs batch size, and throughput.

``profile_decode_latency`` (the per-instance cost curve PTL(BS) the planner and ``streamrl
profile`` fit), ``context_cost`` (the step cost per running context token) and
``measure_throughput`` (end-to-end output tokens/s). Each takes either a ``GenerationEngine``
(measured through its public API, so any backend works) or a plain transformers causal LM
(measured with its own KV-cache decode loop or ``model.generate``: the no-engine baseline).

Invariants: real tokens are generated, nothing is modelled; engines must be built without a
reachable EOS (``eos_token_id=None``) so every request runs to ``new_tokens``, and a request that
stops early raises. ``python -m streamrl.lab.profiling.decode`` prints the tables for a ~1M-param
Qwen2.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import torch

from streamrl.sgs.engines.base import GenerationEngine
from streamrl.types import GenRequest

_ids = itertools.count()


def random_prompts(batch_size: int, prompt_len: int, vocab: int, seed: int) -> list[tuple[int, ...]]:
    g = torch.Generator().manual_seed(seed)
    return [tuple(torch.randint(0, vocab, (prompt_len,), generator=g).tolist()) for _ in range(batch_size)]


def _vocab(model: Any) -> int:
    return int(model.config.get_text_config().vocab_size)


def engine_run(engine: GenerationEngine, prompts: list[tuple[int, ...]], new_tokens: int) -> tuple[float, int]:
    """Submit all prompts at once, wait for all; return (wall seconds, output tokens)."""
    if engine.num_pending():
        raise RuntimeError(f"profiling needs an idle engine; {engine.num_pending()} requests are pending")
    t0 = time.perf_counter()
    for p in prompts:
        i = next(_ids)
        engine.add_request(GenRequest(request_id=f"profile-{i}", prompt_id="profile", sample_idx=i,
                                      prompt_ids=p, max_new_tokens=new_tokens))
    tokens = done = 0
    while done < len(prompts):
        for c in engine.get_completions(timeout=600):
            if len(c.output_ids) != new_tokens:
                raise ValueError(f"{c.request_id} stopped after {len(c.output_ids)} of {new_tokens} tokens "
                                 f"({c.finish_reason}); profile with eos_token_id=None")
            tokens += len(c.output_ids)
            done += 1
    return time.perf_counter() - t0, tokens


@torch.no_grad()
def _model_decode_s(model: Any, prompts: list[tuple[int, ...]], new_tokens: int) -> float:
    """Prefill, then time ``new_tokens`` single-token KV-cache steps of the whole batch."""
    ids = torch.tensor(prompts)
    out = model(ids, use_cache=True)
    cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    t0 = time.perf_counter()
    for _ in range(new_tokens):
        out = model(nxt, past_key_values=cache, use_cache=True)
        cache = out.past_key_values
        nxt = torch.multinomial(torch.softmax(out.logits[:, -1].float(), -1), 1)
    return time.perf_counter() - t0


def profile_decode_latency(engine_or_model: Any, batch_sizes: list[int], prompt_len: int = 16,
                           new_tokens: int = 64, seed: int = 0) -> list[dict[str, float]]:
    """Per-token decode latency at each number of running requests:
    ``[{"batch_size", "ms_per_token", "tokens_per_s"}]``.

    The time of one decode step (every running request gains one token) with ``batch_size``
    requests running. For an engine it is the difference of two runs (``new_tokens`` tokens vs 1
    token, same prompts) divided by ``new_tokens - 1``, which removes prefill and admission cost."""
    if new_tokens < 2:
        raise ValueError(f"new_tokens={new_tokens} must be >= 2 (latency is a difference of two runs)")
    is_engine = isinstance(engine_or_model, GenerationEngine)
    model = getattr(engine_or_model, "model", None) if is_engine else engine_or_model
    vocab = _vocab(model) if model is not None else 2
    rows = []
    for b in batch_sizes:
        prompts = random_prompts(b, prompt_len, vocab, seed)
        if is_engine:
            engine_run(engine_or_model, prompts[:1], 2)  # warm-up
            one, _ = engine_run(engine_or_model, prompts, 1)
            full, _ = engine_run(engine_or_model, prompts, new_tokens)
            step_s = max(full - one, 0.0) / (new_tokens - 1)
        else:
            _model_decode_s(engine_or_model, prompts[:1], 2)  # warm-up
            step_s = _model_decode_s(engine_or_model, prompts, new_tokens) / new_tokens
        rows.append({"batch_size": b, "ms_per_token": 1000 * step_s,
                     "tokens_per_s": b / step_s if step_s > 0 else float("inf")})
    return rows


KV_BATCH, KV_EXTRA_CONTEXT = 16, 200


def context_cost(engine_or_model: Any, rows: list[dict[str, float]], prompt_len: int, new_tokens: int = 64,
                 seed: int = 0, repeats: int = 1) -> dict[str, float]:
    """The decode-step cost per running context token (``LatencyModel.kv_ms_per_token``).

    ``rows`` are this engine's ``profile_decode_latency`` rows at ``prompt_len``. The batch of
    ``KV_BATCH`` (or the largest measured one below it) is run again with ``KV_EXTRA_CONTEXT`` more
    prompt tokens each (median of ``repeats``); the added ms per step divided by the added context
    tokens is the cost."""
    import statistics

    by = {int(r["batch_size"]): r["ms_per_token"] for r in rows}
    b = max((x for x in by if x <= KV_BATCH), default=min(by))
    long_ms = statistics.median(
        profile_decode_latency(engine_or_model, [b], prompt_len=prompt_len + KV_EXTRA_CONTEXT, new_tokens=new_tokens,
                               seed=seed)[0]["ms_per_token"] for _ in range(max(1, repeats)))
    return {"kv_ms_per_token": max(long_ms - by[b], 0.0) / (b * KV_EXTRA_CONTEXT),
            "batch_size": b, "extra_context": KV_EXTRA_CONTEXT, "ms_per_token_short": by[b], "ms_per_token_long": long_ms}


@torch.no_grad()
def measure_throughput(engine_or_model: Any, batch_size: int, new_tokens: int = 100, prompt_len: int = 16,
                       seed: int = 0) -> dict[str, float]:
    """End-to-end output tokens/s for ``batch_size`` requests of ``new_tokens`` each, submitted
    together: ``{"batch_size", "tokens_per_s", "wall_s", "tokens"}``."""
    is_engine = isinstance(engine_or_model, GenerationEngine)
    model = engine_or_model.model if is_engine else engine_or_model
    prompts = random_prompts(batch_size, prompt_len, _vocab(model), seed)
    if is_engine:
        engine_run(engine_or_model, prompts[:1], 2)  # warm-up
        wall, tokens = engine_run(engine_or_model, prompts, new_tokens)
    else:
        ids = torch.tensor(prompts)
        kw = dict(do_sample=True, top_k=0, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                  eos_token_id=None, pad_token_id=0, attention_mask=torch.ones_like(ids))
        model.generate(ids[:1], **{**kw, "max_new_tokens": 2, "min_new_tokens": 2,
                                   "attention_mask": torch.ones_like(ids[:1])})  # warm-up
        t0 = time.perf_counter()
        out = model.generate(ids, **kw)
        wall = time.perf_counter() - t0
        tokens = int(out[:, ids.shape[1]:].numel())
    return {"batch_size": batch_size, "tokens_per_s": tokens / wall, "wall_s": wall, "tokens": tokens}


def _main() -> None:  # pragma: no cover - a benchmark, run by hand
    import argparse
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--latency-batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    ap.add_argument("--new-tokens", type=int, default=100)
    args = ap.parse_args()

    from transformers import Qwen2Config, Qwen2ForCausalLM

    from streamrl.sgs.engines.base import make_engine

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=64, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    print(f"params: {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M")
    for threads in args.threads:
        torch.set_num_threads(threads)
        base = [measure_throughput(model, b, args.new_tokens) for b in args.batches]
        base_lat = profile_decode_latency(model, args.latency_batches)
        engine = make_engine("transformers", model, num_threads=threads, num_blocks=512, page_size=32,
                             max_batch_tokens=1024, max_requests_per_batch=64, seed=0)
        try:
            cb = [measure_throughput(engine, b, args.new_tokens) for b in args.batches]
            cb_lat = profile_decode_latency(engine, args.latency_batches)
        finally:
            engine.shutdown()
        for b, g, c in zip(args.batches, base, cb):
            print(f"threads={threads} batch={b:3d}  generate {g['tokens_per_s']:7.0f} tok/s   "
                  f"cb-engine {c['tokens_per_s']:7.0f} tok/s")
        for g, c in zip(base_lat, cb_lat):
            print(f"threads={threads} running={g['batch_size']:3d}  generate-loop {g['ms_per_token']:6.2f} ms/step   "
                  f"cb-engine {c['ms_per_token']:6.2f} ms/step")


if __name__ == "__main__":
    _main()

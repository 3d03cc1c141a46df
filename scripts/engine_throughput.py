"""Decode throughput of one engine backend on a checkpoint: tokens/s at several batch sizes.

    python scripts/engine_throughput.py --engine vllm --policy .cache/tiny-policy --batches 1,8,32

Every request gets the same prompt and ignores EOS (``eos_token_id=None``), so each batch of
``b`` requests generates exactly ``b * tokens`` tokens; tokens/s is that over the wall time from
the first ``add_request`` to the last completion (prefill included, engine start excluded).
Run each backend in its own process (vLLM's CPU worker pins torch's thread count for the whole
process). Prints one JSON line per batch size.

GRPO batches: ``--group 8 --prompt-tokens 160`` gives each batch ``batch / 8`` distinct prompts of
160 tokens, each sent 8 times (one group), and ``--prefix-cache on|off`` sets the engine's prefix
cache; the line then carries the prompt tokens vLLM found cached (``prefix_cached_tokens``).
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", required=True, choices=["transformers", "vllm"])
    ap.add_argument("--policy", required=True, help="HF checkpoint directory (the tiny policy)")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes")
    ap.add_argument("--tokens", type=int, default=128, help="new tokens per request")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2, help="timed rounds per batch size (best is reported)")
    ap.add_argument("--group", type=int, default=0, help="samples per distinct prompt (0: one prompt for all)")
    ap.add_argument("--prompt-tokens", type=int, default=8, help="tokens per prompt")
    ap.add_argument("--prefix-cache", choices=["on", "off"], default=None, help="the engine's prefix cache")
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from streamrl.sgs.engines.base import make_engine
    from streamrl.types import GenRequest

    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(temperature=1.0, eos_token_id=None, num_threads=args.threads, seed=0, max_requests_per_batch=max(batches),
              max_batch_tokens=max(1024, args.prompt_tokens * 2),
              num_blocks=max(64, max(batches) * ((args.tokens + args.prompt_tokens) // 32 + 2)), page_size=32)
    if args.prefix_cache is not None:
        kw["prefix_cache"] = args.prefix_cache == "on"
    if args.engine == "transformers":
        from streamrl.models.tiny import load_policy

        model = load_policy(args.policy)[0].eval()
    else:
        model = args.policy
    t0 = time.perf_counter()
    engine = make_engine(args.engine, model, **kw)
    start_s = time.perf_counter() - t0
    warm = True
    rounds = 0
    try:
        for b in [1] + batches:  # the first batch of 1 warms up (not reported)
            best = None
            cached0 = engine.stats().get("gen/prefix_cached_tokens", 0)
            for r in range(args.repeats):
                rounds += 1
                t = time.perf_counter()
                for i in range(b):
                    group = i // args.group if args.group else 0
                    # distinct per round and group (ids 1..97 of any vocabulary), shared within a group
                    prompt = tuple((rounds * 7919 + group * 104729 + 31 * k) % 97 + 1 for k in range(args.prompt_tokens))
                    engine.add_request(GenRequest(request_id=f"b{b}-r{r}-{i}", prompt_id="p", sample_idx=i,
                                                  prompt_ids=prompt, max_new_tokens=args.tokens))
                n = 0
                while n < b:
                    n += len(engine.get_completions(timeout=600))
                dt = time.perf_counter() - t
                best = dt if best is None else min(best, dt)
            if warm:
                warm = False
                continue
            print(json.dumps({"engine": args.engine, "batch": b, "tokens": args.tokens, "threads": args.threads,
                              "seconds": round(best, 3), "tokens_per_s": round(b * args.tokens / best, 1),
                              "engine_start_s": round(start_s, 1), "load_avg_1m": os.getloadavg()[0],
                              "prompt_tokens": args.prompt_tokens, "group": args.group,
                              "prefix_cached_tokens": engine.stats().get("gen/prefix_cached_tokens", 0) - cached0,
                              "prompt_tokens_sent": b * args.prompt_tokens * args.repeats}), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

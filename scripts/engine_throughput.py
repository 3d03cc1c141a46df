"""Decode throughput of one engine backend on a checkpoint: tokens/s at several batch sizes.

    python scripts/engine_throughput.py --engine vllm --policy .cache/tiny-policy --batches 1,8,32

Every request gets the same prompt and ignores EOS (``eos_token_id=None``), so each batch of
``b`` requests generates exactly ``b * tokens`` tokens; tokens/s is that over the wall time from
the first ``add_request`` to the last completion (prefill included, engine start excluded).
Run each backend in its own process (vLLM's CPU worker pins torch's thread count for the whole
process). Prints one JSON line per batch size.
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
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    torch.set_num_threads(args.threads)
    from streamrl.sgs.engines.base import make_engine
    from streamrl.types import GenRequest

    batches = [int(b) for b in args.batches.split(",")]
    kw = dict(temperature=1.0, eos_token_id=None, num_threads=args.threads, seed=0, max_requests_per_batch=max(batches),
              max_batch_tokens=1024, num_blocks=max(64, max(batches) * (args.tokens // 32 + 2)), page_size=32)
    if args.engine == "transformers":
        from streamrl.models.tiny import load_policy

        model = load_policy(args.policy)[0].eval()
    else:
        model = args.policy
    t0 = time.perf_counter()
    engine = make_engine(args.engine, model, **kw)
    start_s = time.perf_counter() - t0
    prompt = (1, 5, 6, 7, 8, 9, 10, 11)
    warm = True
    try:
        for b in [1] + batches:  # the first batch of 1 warms up (not reported)
            best = None
            for r in range(args.repeats):
                t = time.perf_counter()
                for i in range(b):
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
                              "engine_start_s": round(start_s, 1), "load_avg_1m": os.getloadavg()[0]}), flush=True)
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()

"""Held-out evaluation: accuracy and lengths at the training temperature, through the
pipeline's own generation (the current weights)."""

from __future__ import annotations

import numpy as np

from streamrl.controller.common import length_stats

def evaluate(pipeline, ctx, prompts, samples_per_prompt: int, tag: str) -> dict[str, float]:
    """Held-out accuracy (mean verifiable reward at the training temperature) and lengths."""
    ctx.scorer.register(prompts)
    n_saved = ctx.builder.n
    ctx.builder.n = samples_per_prompt
    try:
        requests = ctx.builder.build(prompts, iteration=0, tag=f"eval-{tag}-")
    finally:
        ctx.builder.n = n_saved
    completions = pipeline.generate(requests)
    samples = ctx.scorer.score_many(completions, 0)
    lengths = [s.num_response_tokens for s in samples]
    return {"eval/accuracy": float(np.mean([s.reward >= 1.0 for s in samples])),
            "eval/reward": float(np.mean([s.reward for s in samples])), "eval/samples": len(samples),
            **length_stats(lengths, "eval/resp_len")}

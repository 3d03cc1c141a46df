"""Length statistics of the policy's responses on a task (`streamrl task stats`).

The long-tail criteria the benchmarks rely on: p99/p50 of response length >= 5, the longest 10%
of responses hold >= 30% of all response tokens, and Spearman(prompt tokens, response tokens)
<= 0.6 (NaN, constant prompt lengths, counts as none; length is not just a function of prompt length, so ranking it is a real problem).
"""

from __future__ import annotations

import numpy as np

from streamrl.metrics.stats import spearman

CRITERIA = {"p99_over_p50": (">=", 5.0), "top10_token_share": (">=", 0.30), "spearman_prompt_vs_response": ("<=", 0.6)}


def length_figures(prompt_tokens: list[int], response_tokens: list[int]) -> dict[str, float]:
    r = np.asarray(response_tokens, dtype=float)
    if r.size == 0:
        raise ValueError("no responses to compute statistics on")
    p50, p90, p99 = np.percentile(r, [50, 90, 99])
    top = np.sort(r)[::-1][: max(1, len(r) // 10)]
    return {"responses": int(r.size), "mean": float(r.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(r.max()), "p99_over_p50": float(p99 / max(p50, 1e-9)),
            "top10_token_share": float(top.sum() / r.sum()),
            "spearman_prompt_vs_response": spearman(prompt_tokens, response_tokens)}


def check_criteria(figures: dict[str, float]) -> dict[str, bool]:
    out = {}
    for key, (op, bound) in CRITERIA.items():
        # a correlation of NaN (constant prompt lengths) is no correlation: "<=" holds
        out[key] = figures[key] >= bound if op == ">=" else not figures[key] > bound
    return out

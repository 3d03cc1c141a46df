"""How well a ranker orders samples by output length: top-x% recall, Spearman, and the ceiling.

Only the order of the scores matters to dispatch (PAPER.md §3.6–3.7), so every metric here is
rank-based; all functions are pure numpy.

- ``recall_at_top(true, scores, frac)``: the paper's Table 4 metric, with ties handled exactly
  (a constant score gives exactly ``k / n``, the random baseline; see the function).
- ``spearman(a, b)``: Pearson correlation of the average ranks (ties get the mean of the ranks
  they span), the textbook tie-corrected Spearman; NaN when either side is constant.
- ``ceiling_scores``: per sample, the mean length of its prompt's *other* samples (leave-one-out),
  or the mean of a reference set's samples of the same prompt (what a ranker could have seen).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Hashable, Sequence

import numpy as np

from streamrl.metrics.stats import _as_1d, average_ranks, spearman  # noqa: F401  (re-exported)

DEFAULT_FRACS = (0.2, 0.1, 0.05)


def top_k(n: int, frac: float) -> int:
    """Size of the top-``frac`` set of ``n`` samples: ``max(1, round(frac * n))``."""
    if not 0.0 < frac <= 1.0:
        raise ValueError(f"frac must be in (0, 1], got {frac}")
    if n <= 0:
        raise ValueError(f"need at least one sample, got n={n}")
    return max(1, int(round(frac * n)))


def top_membership(values: np.ndarray, k: int) -> np.ndarray:
    """Probability that each sample is among the ``k`` largest when ties are broken at random."""
    kth = np.sort(values)[::-1][k - 1]
    above = values > kth
    tied = values == kth
    member = above.astype(np.float64)
    member[tied] = (k - above.sum()) / tied.sum()
    return member


def recall_at_top(true_lengths: Sequence[float], scores: Sequence[float], frac: float) -> float:
    """Expected fraction of the true longest ``frac`` found in the predicted longest ``frac``.

    Of the true longest ``k = max(1, round(frac * n))`` samples, the fraction found among the
    ``k`` highest scores (the same ``k`` as ``streamrl.lab.sim.workload.top_recall``). Ties are
    broken uniformly at random, independently for the true lengths and for the scores, and the
    result is the *expected* recall under that tie-breaking, computed exactly rather than
    sampled: each sample gets a membership ``t_i`` in the true top-k (1 above the k-th largest
    length, 0 below it, ``slots_left / n_tied`` for the samples tied with the k-th value) and a
    membership ``p_i`` in the predicted top-k (same rule on the scores); the recall is
    ``sum(t_i * p_i) / k``. So a constant score gives exactly ``k / n``, and a ranker cannot gain
    or lose by the order in which tied samples happen to sit."""
    t = _as_1d("true_lengths", true_lengths)
    s = _as_1d("scores", scores)
    if t.shape != s.shape:
        raise ValueError(f"true_lengths and scores differ in length: {t.size} vs {s.size}")
    k = top_k(t.size, frac)
    return float(np.dot(top_membership(t, k), top_membership(s, k)) / k)


def rank_metrics(true_lengths: Sequence[float], scores: Sequence[float],
                 fracs: Sequence[float] = DEFAULT_FRACS) -> dict[str, float]:
    """``{"recall@20%": ..., "recall@10%": ..., "recall@5%": ..., "spearman": ...}`` for one batch."""
    out = {f"recall@{frac * 100:g}%": recall_at_top(true_lengths, scores, frac) for frac in fracs}
    out["spearman"] = spearman(true_lengths, scores)
    return out


def ceiling_scores(keys: Sequence[Hashable], lengths: Sequence[float],
                   ref_keys: Sequence[Hashable] | None = None,
                   ref_lengths: Sequence[float] | None = None) -> np.ndarray:
    """The ceiling ranker's scores: the mean length of the same prompt's other samples.

    Without a reference set: leave-one-out within ``(keys, lengths)`` (the noise ceiling of any
    ranker that sees only the prompt). With ``ref_keys``/``ref_lengths``: the mean of the
    reference samples of the same prompt (the ceiling under a protocol where only the reference
    set could have been seen). A sample whose prompt has no other/reference sample gets the
    global mean of the reference (or of all samples): it carries no prompt information.
    """
    lens = _as_1d("lengths", lengths)
    if len(keys) != lens.size:
        raise ValueError(f"keys and lengths differ in length: {len(keys)} vs {lens.size}")
    sums: dict[Hashable, float] = defaultdict(float)
    counts: dict[Hashable, int] = defaultdict(int)
    if ref_keys is None:
        for k, x in zip(keys, lens):
            sums[k] += x
            counts[k] += 1
        fallback = float(lens.mean())
        out = np.empty(lens.size)
        for i, (k, x) in enumerate(zip(keys, lens)):
            n = counts[k] - 1
            out[i] = (sums[k] - x) / n if n > 0 else fallback
        return out
    if ref_lengths is None:
        raise ValueError("ref_keys given without ref_lengths")
    ref = _as_1d("ref_lengths", ref_lengths)
    if len(ref_keys) != ref.size:
        raise ValueError(f"ref_keys and ref_lengths differ in length: {len(ref_keys)} vs {ref.size}")
    for k, x in zip(ref_keys, ref):
        sums[k] += x
        counts[k] += 1
    fallback = float(ref.mean()) if ref.size else float(lens.mean())
    return np.array([sums[k] / counts[k] if counts.get(k) else fallback for k in keys])

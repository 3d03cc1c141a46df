"""Rank statistics shared by the ranker's metrics and the task's length figures (pure numpy).

``spearman`` is the textbook tie-corrected Spearman (Pearson correlation of average ranks); it is
NaN when either side is constant, since no order is there to correlate.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def _as_1d(name: str, values) -> np.ndarray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        bad = arr[~np.isfinite(arr)][:5].tolist()
        raise ValueError(f"{name} has non-finite values, e.g. {bad}")
    return arr


def average_ranks(values: Sequence[float]) -> np.ndarray:
    """Ranks 1..n, tied values sharing the mean of the ranks they occupy."""
    v = _as_1d("values", values)
    order = np.argsort(v, kind="stable")
    sorted_v = v[order]
    # Start index of each run of equal values, and the run each sorted position belongs to.
    starts = np.flatnonzero(np.r_[True, sorted_v[1:] != sorted_v[:-1]])
    ends = np.r_[starts[1:], v.size]
    run_rank = (starts + ends + 1) / 2.0  # mean of 1-based ranks starts+1 .. ends
    ranks = np.empty(v.size)
    ranks[order] = np.repeat(run_rank, ends - starts)
    return ranks


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman rank correlation with average ranks for ties; NaN if either input is constant."""
    ra, rb = average_ranks(a), average_ranks(b)
    if ra.shape != rb.shape:
        raise ValueError(f"inputs differ in length: {ra.size} vs {rb.size}")
    if ra.size < 2:
        raise ValueError(f"Spearman needs at least 2 samples, got {ra.size}")
    da, db = ra - ra.mean(), rb - rb.mean()
    denom = np.sqrt(np.dot(da, da) * np.dot(db, db))
    if denom == 0.0:
        return float("nan")
    return float(np.dot(da, db) / denom)

"""Gradient-boosted regression trees in numpy: the non-linear half of the learned ranker.

    x (m rows x F dense features) ──bin_edges──> per feature, up to max_bins sorted thresholds
    x ──to_bins──> xb (m x F ints; x <= edges[f][b]  <=>  xb[:, f] <= b)
    (xb, y, w) ──rounds chosen by k-fold CV over rows──> R
    (xb, y, w) ──R rounds of boosting, one depth-d tree per round──> BoostedTrees
    BoostedTrees.predict(x) = weighted mean of y + sum over trees of leaf value(x)

Squared loss; complete trees grown level by level (``_grow``); the round count by
cross-validation (``fit_boosted_trees``, which also says why not LightGBM). Invariant: fitting
is deterministic; the only randomness is the fold assignment, drawn from ``seed``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def bin_edges(x: np.ndarray, max_bins: int) -> list[np.ndarray]:
    """Per column, the sorted thresholds: its distinct values, or ``max_bins`` quantiles if more."""
    edges = []
    for col in np.asarray(x, dtype=np.float64).T:
        values = np.unique(col)
        if values.size > max_bins:
            values = np.unique(np.quantile(col, np.linspace(0.0, 1.0, max_bins)))
        edges.append(values)
    return edges


def to_bins(x: np.ndarray, edges: list[np.ndarray]) -> np.ndarray:
    """Bin index per value: the first threshold >= the value (values above the last share its bin)."""
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(edges):
        raise ValueError(f"x must have shape (n, {len(edges)}), got {x.shape}")
    out = np.empty(x.shape, dtype=np.int64)
    for f, e in enumerate(edges):
        out[:, f] = np.minimum(np.searchsorted(e, x[:, f], side="left"), e.size - 1)
    return out


def _grow(xb: np.ndarray, grad: np.ndarray, hess: np.ndarray, depth: int, l2: float, min_leaf: float,
          n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One tree: split feature and bin per node (``depth x 2**(depth-1)``), leaf values, leaf of each row.

    Squared loss, so each round fits the current residuals: a row's gradient is
    ``w * (pred - y)`` and its hessian ``w``. The tree is complete (``2**depth`` leaves) and grown
    level by level: one ``bincount`` gives every node's gradient and hessian histogram over the
    bins of every feature, and each node takes its best split at once (XGBoost gain with an L2
    penalty ``l2`` on leaf values; a child lighter than ``min_leaf`` is refused). A node with no
    split that gains sends all its rows left, so its right child is empty and never reached in
    training. Leaf values are ``-G / (H + l2)`` (``_boost`` scales them by the learning rate)."""
    m, n_feat = xb.shape
    width = 1 << (depth - 1)
    feats = np.zeros((depth, width), dtype=np.int64)
    bins = np.full((depth, width), n_bins - 1, dtype=np.int64)
    rows = np.arange(m)
    col_offset = np.arange(n_feat) * n_bins
    g_rep, h_rep = np.repeat(grad, n_feat), np.repeat(hess, n_feat)
    node = np.zeros(m, dtype=np.int64)
    for level in range(depth):
        nodes = 1 << level
        idx = (node[:, None] * (n_feat * n_bins) + col_offset + xb).ravel()
        size = nodes * n_feat * n_bins
        g_left = np.bincount(idx, g_rep, minlength=size).reshape(nodes, n_feat, n_bins).cumsum(2)
        h_left = np.bincount(idx, h_rep, minlength=size).reshape(nodes, n_feat, n_bins).cumsum(2)
        g_all, h_all = g_left[:, :, -1:], h_left[:, :, -1:]
        gain = (g_left ** 2 / (h_left + l2) + (g_all - g_left) ** 2 / (h_all - h_left + l2)
                - g_all ** 2 / (h_all + l2))
        allowed = (h_left >= min_leaf) & (h_all - h_left >= min_leaf)
        gain = np.where(allowed, gain, 0.0).reshape(nodes, -1)
        best = gain.argmax(1)
        useful = gain[np.arange(nodes), best] > 1e-12
        feats[level, :nodes] = np.where(useful, best // n_bins, 0)
        bins[level, :nodes] = np.where(useful, best % n_bins, n_bins - 1)
        node = 2 * node + (xb[rows, feats[level, node]] > bins[level, node])
    leaves = 1 << depth
    g_leaf = np.bincount(node, grad, minlength=leaves)
    h_leaf = np.bincount(node, hess, minlength=leaves)
    return feats, bins, -g_leaf / (h_leaf + l2), node


def _boost(xb: np.ndarray, y: np.ndarray, w: np.ndarray, rounds: int, depth: int, learning_rate: float,
           l2: float, min_leaf: float, n_bins: int) -> tuple[float, np.ndarray, np.ndarray, np.ndarray]:
    """``rounds`` trees on binned rows; returns (base, feats, bins, leaves) stacked over rounds."""
    base = float(np.average(y, weights=w))
    pred = np.full(y.size, base)
    width = 1 << (depth - 1)
    feats = np.zeros((rounds, depth, width), dtype=np.int64)
    bins = np.zeros((rounds, depth, width), dtype=np.int64)
    leaves = np.zeros((rounds, 1 << depth))
    for r in range(rounds):
        f, b, leaf, node = _grow(xb, w * (pred - y), w, depth, l2, min_leaf, n_bins)
        feats[r], bins[r], leaves[r] = f, b, learning_rate * leaf
        pred += leaves[r][node]
    return base, feats, bins, leaves


def _contributions(xb: np.ndarray, feats: np.ndarray, bins: np.ndarray, leaves: np.ndarray) -> np.ndarray:
    """Each tree's output for each row: shape ``(n, rounds)``."""
    n, rounds = xb.shape[0], feats.shape[0]
    r = np.arange(rounds)[None, :]
    node = np.zeros((n, rounds), dtype=np.int64)
    for level in range(feats.shape[1]):
        split_feat = feats[r, level, node]
        node = 2 * node + (np.take_along_axis(xb, split_feat, axis=1) > bins[r, level, node])
    return leaves[r, node]


@dataclass(frozen=True)
class BoostedTrees:
    """A fitted ensemble: thresholds per feature, the base value and the trees' splits and leaves."""

    edges: list[np.ndarray]
    base: float
    feats: np.ndarray
    bins: np.ndarray
    leaves: np.ndarray

    @property
    def rounds(self) -> int:
        return int(self.feats.shape[0])

    def predict(self, x: np.ndarray) -> np.ndarray:
        xb = to_bins(x, self.edges)
        if self.rounds == 0:
            return np.full(xb.shape[0], self.base)
        return self.base + _contributions(xb, self.feats, self.bins, self.leaves).sum(1)


def fit_boosted_trees(x: np.ndarray, y: np.ndarray, w: np.ndarray, *, max_rounds: int = 300, depth: int = 3,
                      learning_rate: float = 0.1, l2: float = 1.0, min_leaf: float = 2.0, max_bins: int = 64,
                      folds: int = 4, seed: int = 0) -> tuple[BoostedTrees, np.ndarray]:
    """Trees with the round count chosen by k-fold CV; returns them and the out-of-fold predictions.

    ``x``: (m, F) features, ``y``: (m,) targets, ``w``: (m,) positive row weights. Needs at least
    two rows per fold. CV: boost on each training part up to ``max_rounds``, score the held-out
    part after every round, and take the round count with the lowest held-out weighted MSE
    averaged over the folds (0 rounds = predict the mean, so trees that only overfit are switched
    off). The out-of-fold predictions at that round count come back with the model, for the
    caller to compare with other learners' held-out predictions.

    Hand-written rather than LightGBM: the data are a few hundred rows of ~20 features, where
    this numpy version, CV included, is fast enough; LightGBM would add two binary dependencies
    (it needs scipy) to the project for that.
    """
    x = np.asarray(x, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    m = y.size
    if x.ndim != 2 or x.shape[0] != m or w.shape != (m,):
        raise ValueError(f"x must be (m, F) with y and w of length m; got x {x.shape}, y {y.shape}, w {w.shape}")
    if np.any(w <= 0) or not np.all(np.isfinite(w)):
        raise ValueError(f"weights must be finite and > 0, got min {w.min()}")
    if folds < 2 or m < 2 * folds:
        raise ValueError(f"need folds >= 2 and at least 2 rows per fold; got folds={folds}, rows={m}")
    if max_rounds < 0 or depth < 1:
        raise ValueError(f"max_rounds must be >= 0 and depth >= 1, got {max_rounds}, {depth}")
    w = w / w.mean()  # so l2 and min_leaf are in units of "rows" whatever the weights are
    edges = bin_edges(x, max_bins)
    xb = to_bins(x, edges)
    n_bins = max(e.size for e in edges)
    fold = np.random.default_rng(seed).permutation(m) % folds
    curves = np.zeros((folds, max_rounds + 1))
    held = np.zeros((m, max_rounds + 1))  # out-of-fold prediction after each round count
    for f in range(folds):
        train, test = fold != f, fold == f
        base, feats, bins, leaves = _boost(xb[train], y[train], w[train], max_rounds, depth, learning_rate, l2,
                                           min_leaf, n_bins)
        steps = _contributions(xb[test], feats, bins, leaves)
        held[test] = base + np.hstack([np.zeros((steps.shape[0], 1)), steps.cumsum(1)])
        curves[f] = np.average((held[test] - y[test, None]) ** 2, weights=w[test], axis=0)
    rounds = int(np.argmin(curves.mean(0)))
    base, feats, bins, leaves = _boost(xb, y, w, rounds, depth, learning_rate, l2, min_leaf, n_bins)
    return BoostedTrees(edges, base, feats, bins, leaves), held[:, rounds]

"""Learned rankers on the prompt text: a ridge on hashed n-grams, and boosted trees on character positions.

``LearnedRanker`` (``learned``, the default); ``RidgeRanker`` (``learned-ridge``) is the ridge alone::

    samples (text, length) ──group by text──> m unique prompts, y = mean log1p length, w = count
    ├─ ridge: hashed char n-grams + counts ──kernel ridge, λ by exact leave-one-prompt-out──> r(x), LOO r_i
    ├─ trees: code points of the first and last K characters + counts
    │         ──boosted trees (``trees.py``), rounds by 4-fold CV over prompts──> t(x), out-of-fold t_i
    └─ β in {0, 0.1, ..., 1}: lowest weighted held-out MSE of  β r_i + (1 - β) t_i
    score(texts) = expm1(β r(x) + (1 - β) t(x))

Invariant: ``update`` refits on the last ``window`` samples aside, then swaps under a lock. Why: the classes.
"""

from __future__ import annotations

import math
import re
import threading
from abc import abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from streamrl.ranker.base import Ranker, check_samples
from streamrl.ranker.trees import fit_boosted_trees

_PRIME = np.uint64(0x100000001B3)
_MIX = np.uint64(0x9E3779B97F4A7C15)
_LATEX = re.compile(r"\\[A-Za-z]+")
_DIGIT = re.compile(r"\d")
_NUMERIC = ("log_chars", "log_digits", "log_dollars", "log_latex_cmds", "log_words")
_BLEND_GRID = np.linspace(0.0, 1.0, 11)


def ngram_buckets(text: str, ns: Sequence[int], bits: int) -> np.ndarray:
    """Bucket index (0 .. 2**bits - 1) of every character n-gram of ``text`` for each n in ``ns``."""
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.uint64)
    out = []
    shift = np.uint64(64 - bits)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64 on purpose
        for n in ns:
            m = codes.size - n + 1
            if m <= 0:
                continue
            h = np.full(m, np.uint64(n) * _MIX, dtype=np.uint64)
            for j in range(n):
                h = h * _PRIME + codes[j:j + m]
            out.append((h * _MIX) >> shift)
    return np.concatenate(out) if out else np.zeros(0, dtype=np.uint64)


def numeric_features(text: str) -> list[float]:
    """Cheap counts that track problem size; order matches ``_NUMERIC``."""
    return [math.log1p(len(text)), math.log1p(len(_DIGIT.findall(text))), math.log1p(text.count("$")),
            math.log1p(len(_LATEX.findall(text))), math.log1p(len(text.split()))]


def position_codes(texts: Sequence[str], positions: int) -> np.ndarray:
    """Code points of the first and the last ``positions`` characters: shape ``(n, 2 * positions)``.

    Column ``j`` is character ``j`` from the start, column ``positions + j`` character ``j`` from
    the end; -1 where the text is shorter.
    """
    out = np.full((len(texts), 2 * positions), -1.0)
    for i, t in enumerate(texts):
        head, tail = t[:positions], t[::-1][:positions]
        out[i, :len(head)] = [ord(c) for c in head]
        out[i, positions:positions + len(tail)] = [ord(c) for c in tail]
    return out


@dataclass(frozen=True)
class _Fit:
    """A fitted model, its held-out log-length prediction per prompt, and the chosen hyperparameters."""

    model: Any
    held_out: np.ndarray
    params: dict


class _PromptRegressor(Ranker):
    """Regression of mean log length per distinct prompt text, refit on a window of recent samples.

    Samples of one prompt are grouped (their texts are identical), so a fit is over m distinct
    prompts. ``update`` appends to the window of the most recent ``window`` samples and refits;
    the new model is swapped in under a lock, so ``score`` on another thread never sees a
    half-built model."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        self.window = int(window)
        self._lock = threading.Lock()
        self._buffer: deque[tuple[str, float]] = deque(maxlen=self.window)
        self._model: Any = None
        self.params_: dict = {}
        self.loo_rmse_: float | None = None

    @abstractmethod
    def _build(self, uniq: list[str], y: np.ndarray, w: np.ndarray) -> _Fit:
        """Fit on distinct prompts ``uniq`` with mean log lengths ``y`` and sample counts ``w``."""

    @abstractmethod
    def _log_scores(self, model: Any, texts: list[str]) -> np.ndarray:
        """Predicted log1p length of each text under ``model``."""

    def _refit(self) -> None:
        groups: dict[str, list[float]] = {}
        for t, v in list(self._buffer):
            groups.setdefault(t, []).append(v)
        uniq = list(groups)
        w = np.array([len(groups[t]) for t in uniq], dtype=np.float64)
        y = np.array([np.mean(groups[t]) for t in uniq])
        fit = self._build(uniq, y, w)
        err = float(np.sqrt(np.average((fit.held_out - y) ** 2, weights=w)))
        with self._lock:
            self._model, self.params_, self.loo_rmse_ = fit.model, fit.params, err

    def fit(self, texts, lengths, keys=None) -> "_PromptRegressor":
        texts, lens, _ = check_samples(texts, lengths, keys)
        if not texts:
            raise ValueError("fit needs at least one sample")
        with self._lock:
            self._buffer.clear()
            self._buffer.extend(zip(texts, np.log1p(lens).tolist()))
        self._refit()
        return self

    def update(self, texts, lengths, keys=None) -> None:
        texts, lens, _ = check_samples(texts, lengths, keys)
        with self._lock:
            self._buffer.extend(zip(texts, np.log1p(lens).tolist()))
        self._refit()

    def score(self, texts, keys=None) -> np.ndarray:
        texts, _, _ = check_samples(texts, None, keys)
        with self._lock:
            model = self._model
        if model is None:
            raise RuntimeError(f"{type(self).__name__}.score called before fit")
        if not texts:
            return np.zeros(0)
        return np.expm1(np.minimum(self._log_scores(model, texts), 50.0))  # monotone: order kept


class RidgeRanker(_PromptRegressor):
    """Weighted ridge regression of log output length on hashed char n-grams of the prompt.

    Why a ridge: with no pretrained weights the ranker learns from the few hundred prompts of one
    policy's history and must rank new prompts; a ridge fits fast and ranked held-out prompts
    better than a small char-CNN (docs/experiments.md). With few prompts nothing beats prompt
    length by much: the text carries little length signal beyond size; history
    (``history.py``) does.

    Features: character 1–4-grams hashed (stable multiply-shift hash, not Python's salted
    ``hash``) into ``2**hash_bits`` buckets, sublinear counts ``log1p``, each row L2-normalised;
    plus standardised numeric columns (log chars, log digits, log ``$``, log LaTeX commands, log
    words). The ridge is an m x m system (m distinct prompts), solved once by eigendecomposition
    for all candidate λ.

    Args:
        hash_bits: log2 of the number of n-gram buckets.
        ngrams: the n-gram orders used.
        numeric_weight: scale of the standardised numeric columns relative to the unit-norm
            n-gram block (0 drops them).
        alphas: candidate ridge strengths; the one with the lowest leave-one-prompt-out error wins.
        window: samples kept for online refits (the most recent ones).
    """

    name = "learned-ridge"

    def __init__(self, hash_bits: int = 13, ngrams: Sequence[int] = (1, 2, 3, 4), numeric_weight: float = 0.5,
                 alphas: Sequence[float] = (0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0), window: int = 4096):
        if not 8 <= hash_bits <= 20:
            raise ValueError(f"hash_bits must be in [8, 20], got {hash_bits}")
        if not ngrams or any(int(n) < 1 for n in ngrams):
            raise ValueError(f"ngrams must be positive orders, got {ngrams}")
        if numeric_weight < 0:
            raise ValueError(f"numeric_weight must be >= 0, got {numeric_weight}")
        if not alphas or any(a <= 0 for a in alphas):
            raise ValueError(f"alphas must be positive, got {alphas}")
        super().__init__(window)
        self.hash_bits, self.ngrams = int(hash_bits), tuple(int(n) for n in ngrams)
        self.numeric_weight, self.alphas = float(numeric_weight), tuple(alphas)

    def _ngram_matrix(self, texts: Sequence[str]) -> np.ndarray:
        dim = 1 << self.hash_bits
        x = np.zeros((len(texts), dim), dtype=np.float32)
        for i, t in enumerate(texts):
            idx = ngram_buckets(t, self.ngrams, self.hash_bits).astype(np.int64)
            row = np.log1p(np.bincount(idx, minlength=dim).astype(np.float32))
            norm = float(np.linalg.norm(row))
            x[i] = row / norm if norm > 0 else row
        return x

    def _features(self, texts: Sequence[str], num_mu: np.ndarray, num_sd: np.ndarray) -> np.ndarray:
        x = self._ngram_matrix(texts)
        if self.numeric_weight == 0:
            return x
        num = (np.array([numeric_features(t) for t in texts], dtype=np.float32) - num_mu) / num_sd
        return np.hstack([x, self.numeric_weight * num / math.sqrt(len(_NUMERIC))])

    def _build(self, uniq, y, w) -> _Fit:
        """Kernel ridge in the m x m dual, λ by exact leave-one-prompt-out; model = (β, b, num_mu, num_sd)."""
        raw_num = np.array([numeric_features(t) for t in uniq], dtype=np.float32)
        num_mu = raw_num.mean(0)
        num_sd = np.where(raw_num.std(0) > 1e-6, raw_num.std(0), 1.0).astype(np.float32)
        x = self._features(uniq, num_mu, num_sd).astype(np.float64)
        x_mean = (w[:, None] * x).sum(0) / w.sum()
        y_mean = float((w * y).sum() / w.sum())
        if len(uniq) < 3:  # too few prompts to fit anything: predict the mean
            beta = np.zeros(x.shape[1])
            return _Fit((beta, y_mean - float(x_mean @ beta), num_mu, num_sd), np.full(len(uniq), np.nan),
                        {"alpha": float("nan")})
        sw = np.sqrt(w)
        xc = sw[:, None] * (x - x_mean)
        yc = sw * (y - y_mean)
        # H(α) = K (K + αI)^-1; the leave-one-out residual is e / (1 - H_ii).
        evals, evecs = np.linalg.eigh(xc @ xc.T)
        evals = np.clip(evals, 0.0, None)
        proj = evecs.T @ yc
        best = None
        for alpha in self.alphas:
            shrink = evals / (evals + alpha)
            fitted = evecs @ (shrink * proj)
            h_diag = np.einsum("ij,j,ij->i", evecs, shrink, evecs)
            loo = (yc - fitted) / np.maximum(1.0 - h_diag, 1e-9) / sw  # back to log-length units
            err = float(np.average(loo ** 2, weights=w))
            if best is None or err < best[0]:
                best = (err, alpha, loo)
        _, alpha, loo = best
        dual = evecs @ (proj / (evals + alpha))
        beta = xc.T @ dual
        return _Fit((beta, y_mean - float(x_mean @ beta), num_mu, num_sd), y - loo, {"alpha": alpha})

    def _log_scores(self, model, texts) -> np.ndarray:
        beta, b, num_mu, num_sd = model
        return self._features(texts, num_mu, num_sd).astype(np.float64) @ beta + b


class LearnedRanker(_PromptRegressor):
    """The ridge blended with boosted trees on character positions (the module's data flow).

    Why the trees: a ridge on n-gram counts is linear and blind to where an n-gram sits, so it
    cannot express a length set by one character at the start *interacting* with characters at
    the end (the synthetic task: ``U``/``D`` first, then the last digits of ``a`` and the step
    ``s``). Trees on the code point at each of the first and last K positions (left- and
    right-aligned, so prompts of different length line up at both ends) split on such
    interactions without parsing anything task-specific. On math word problems they carry
    little, and β, chosen on held-out predictions, stays at or near 1 (the ridge). Measurements:
    docs/experiments.md.

    The trees see the code points of the first and last ``positions`` characters (-1 past the
    end of a short text) and the same five counts as the ridge, unscaled. They need at least
    ``5 * cv_folds`` distinct prompts; with fewer the learned ranker is the ridge.

    Args:
        positions: characters read at each end of the prompt by the trees.
        max_rounds, depth, learning_rate, l2, min_leaf: the trees (``trees.fit_boosted_trees``);
            the round count is chosen by ``cv_folds``-fold CV up to ``max_rounds``.
        cv_folds: folds over prompts for the trees' round count and out-of-fold predictions.
        seed: the fold assignment (the only randomness).
        ridge: keyword arguments of the ``RidgeRanker`` part (not ``window``).
        window: samples kept for online refits (the most recent ones).
    """

    name = "learned"

    def __init__(self, positions: int = 8, max_rounds: int = 300, depth: int = 3, learning_rate: float = 0.1,
                 l2: float = 1.0, min_leaf: float = 2.0, cv_folds: int = 4, seed: int = 0,
                 ridge: dict | None = None, window: int = 4096):
        if positions < 1:
            raise ValueError(f"positions must be >= 1, got {positions}")
        if max_rounds < 0 or not 1 <= depth <= 8:
            raise ValueError(f"max_rounds must be >= 0 and depth in [1, 8], got {max_rounds}, {depth}")
        if not 0 < learning_rate <= 1 or l2 < 0 or min_leaf < 0:
            raise ValueError(f"need 0 < learning_rate <= 1, l2 >= 0, min_leaf >= 0; got {learning_rate}, {l2}, {min_leaf}")
        if cv_folds < 2:
            raise ValueError(f"cv_folds must be >= 2, got {cv_folds}")
        if ridge and "window" in ridge:
            raise ValueError("ridge kwargs must not set window (the learned ranker's window applies)")
        super().__init__(window)
        self.positions, self.cv_folds, self.seed = int(positions), int(cv_folds), int(seed)
        self.tree_kwargs = {"max_rounds": int(max_rounds), "depth": int(depth), "learning_rate": float(learning_rate),
                            "l2": float(l2), "min_leaf": float(min_leaf)}
        self.ridge = RidgeRanker(**(ridge or {}))

    def _tree_features(self, texts: Sequence[str]) -> np.ndarray:
        return np.hstack([position_codes(texts, self.positions), np.array([numeric_features(t) for t in texts])])

    def _build(self, uniq, y, w) -> _Fit:
        ridge = self.ridge._build(uniq, y, w)
        if len(uniq) < 5 * self.cv_folds:
            return _Fit((ridge.model, None, 1.0), ridge.held_out, {**ridge.params, "rounds": 0, "blend": 1.0})
        trees, held = fit_boosted_trees(self._tree_features(uniq), y, w, folds=self.cv_folds, seed=self.seed,
                                        **self.tree_kwargs)
        errors = [np.average((b * ridge.held_out + (1.0 - b) * held - y) ** 2, weights=w) for b in _BLEND_GRID]
        blend = float(_BLEND_GRID[::-1][int(np.argmin(errors[::-1]))])  # ties: the larger ridge weight
        return _Fit((ridge.model, trees, blend), blend * ridge.held_out + (1.0 - blend) * held,
                    {**ridge.params, "rounds": trees.rounds, "blend": blend})

    def _log_scores(self, model, texts) -> np.ndarray:
        ridge_model, trees, blend = model
        out = np.zeros(len(texts))
        if blend > 0:
            out += blend * self.ridge._log_scores(ridge_model, texts)
        if blend < 1:
            out += (1.0 - blend) * trees.predict(self._tree_features(texts))
        return out

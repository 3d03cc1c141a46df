"""History ranker and the learned+history blend (online length signal, PAPER.md §5: RhymeRL).

``HistoryRanker`` remembers, per prompt key, a decayed running mean of this policy's previous
output lengths (in log space by default); a prompt never seen gets a prior: the median of the
recent samples, or a ``prior`` ranker's score. ``BlendRanker`` shrinks the history towards a
learned prior, weighted by how much history a prompt has (empirical Bayes)::

    est(k) = (S_k + c * prior(k)) / (W_k + c)      S_k, W_k: decayed sum / count of log lengths

so an unseen prompt gets the learned score and a prompt with many samples its own mean.
Invariant: the state is a dict per key that ``update`` mutates and ``score`` reads under one lock
(``update`` may run on a background thread). The choice of ``decay``, space and ``c``: the classes.
"""

from __future__ import annotations

import threading
from collections import deque

import numpy as np

from streamrl.ranker.base import Ranker, check_samples

_SPACES = ("log", "linear")


class HistoryRanker(Ranker):
    """Per-prompt (decayed) mean of previous lengths; unseen prompts get a prior.

    The mean is in log space by default: the long-CoT tail loops to the cap, and a geometric mean
    is not dragged by one capped response. Each ``update`` call is one step (an RL iteration, a
    checkpoint): with ``decay < 1`` the weight of everything seen before is multiplied by
    ``decay`` per step, so the estimate follows a drifting policy. The defaults (log space, no
    decay) come from ``streamrl rank eval`` (figures: docs/design.md): log vs linear and the decay
    made no difference beyond noise, or decay was slightly worse where checkpoints agree on which
    prompts are long.

    Args:
        decay: weight multiplier per step on older samples, in (0, 1]; 1 = plain running mean.
        space: ``"log"`` (mean of log1p length) or ``"linear"`` (mean length).
        prior: a ranker scoring unseen prompts (fit and updated alongside); None = recent median.
        prior_count: pseudo count of the prior in every prompt's mean (0 = pure fallback);
            ``"auto"`` estimates it from the data (see ``BlendRanker``).
        median_window: samples kept for the median prior.
    """

    name = "history"

    def __init__(self, decay: float = 1.0, space: str = "log", prior: Ranker | None = None,
                 prior_count: float | str = 0.0, median_window: int = 4096):
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay must be in (0, 1], got {decay}")
        if space not in _SPACES:
            raise ValueError(f"space must be one of {_SPACES}, got {space!r}")
        if prior_count != "auto" and (isinstance(prior_count, str) or prior_count < 0):
            raise ValueError(f"prior_count must be >= 0 or 'auto', got {prior_count!r}")
        if prior_count == "auto" and prior is None:
            raise ValueError("prior_count='auto' needs a prior ranker (the median has no error estimate)")
        self.decay, self.space, self.prior = float(decay), space, prior
        self.prior_count = prior_count
        self._lock = threading.Lock()
        self._stats: dict[str, list[float]] = {}  # key -> [sum, sum of squares, weight, last step]
        self._recent: deque[float] = deque(maxlen=median_window)
        self._step = 0
        self.prior_count_: float = 0.0 if prior_count == "auto" else float(prior_count)

    def _to_space(self, lens: np.ndarray) -> np.ndarray:
        return np.log1p(lens) if self.space == "log" else lens

    def _from_space(self, v: np.ndarray) -> np.ndarray:
        return np.expm1(np.minimum(v, 50.0)) if self.space == "log" else v

    def _ingest(self, keys: list[str], values: np.ndarray) -> None:
        """Add one step's samples (lock held)."""
        self._step += 1
        for k, v in zip(keys, values):
            st = self._stats.get(k)
            if st is None:
                st = self._stats[k] = [0.0, 0.0, 0.0, self._step]
            fade = self.decay ** (self._step - st[3])
            st[0], st[1], st[2], st[3] = st[0] * fade + v, st[1] * fade + v * v, st[2] * fade + 1.0, self._step
        self._recent.extend(values.tolist())

    def _auto_prior_count(self) -> float:
        """Within-prompt variance / error variance of the prior on prompt means (lock held)."""
        err = getattr(self.prior, "loo_rmse_", None)
        multi = [st for st in self._stats.values() if st[2] > 1.0 + 1e-9]
        if err is None or not np.isfinite(err) or not multi:
            return 1.0  # nothing to estimate from yet: the prior counts as one sample
        ss_within = sum(st[1] - st[0] ** 2 / st[2] for st in multi)
        dof = sum(st[2] - 1.0 for st in multi)
        within = max(ss_within / dof, 1e-6)
        mean_n = float(np.mean([st[2] for st in self._stats.values()]))
        between_err = max(err ** 2 - within / mean_n, 1e-3 * within)
        return float(np.clip(within / between_err, 0.05, 100.0))

    def fit(self, texts, lengths, keys=None) -> "HistoryRanker":
        texts, lens, keys = check_samples(texts, lengths, keys)
        if self.prior is not None:
            self.prior.fit(texts, lens, keys)
        with self._lock:
            self._stats.clear()
            self._recent.clear()
            self._step = 0
            self._ingest(keys, self._to_space(lens))
            if self.prior_count == "auto":
                self.prior_count_ = self._auto_prior_count()
        return self

    def update(self, texts, lengths, keys=None) -> None:
        texts, lens, keys = check_samples(texts, lengths, keys)
        if self.prior is not None:
            self.prior.update(texts, lens, keys)  # refits aside, swaps under its own lock
        with self._lock:
            self._ingest(keys, self._to_space(lens))
            if self.prior_count == "auto":
                self.prior_count_ = self._auto_prior_count()

    def score(self, texts, keys=None) -> np.ndarray:
        texts, _, keys = check_samples(texts, None, keys)
        if self.prior is not None:
            prior = self._to_space(self.prior.score(texts, keys))
        with self._lock:
            if not self._recent:
                raise RuntimeError(f"{type(self).__name__}.score called before fit")
            if self.prior is None:
                prior = np.full(len(keys), float(np.median(np.asarray(self._recent))))
            c = self.prior_count_
            out = prior.copy()
            for i, k in enumerate(keys):
                st = self._stats.get(k)
                if st is None:
                    continue
                fade = self.decay ** (self._step - st[3])
                s, w = st[0] * fade, st[2] * fade
                out[i] = (s + c * prior[i]) / (w + c)
        return self._from_space(out)

    def history_count(self, key: str) -> float:
        """Decayed number of samples remembered for ``key`` (0 if unseen)."""
        with self._lock:
            st = self._stats.get(key)
            return 0.0 if st is None else st[2] * self.decay ** (self._step - st[3])


class BlendRanker(HistoryRanker):
    """History shrunk towards the learned ranker's score by a pseudo count (the module's formula).

    The pseudo count ``c`` is ``"auto"`` by default: the within-prompt variance of log length
    divided by the learned prior's error variance on prompt means (its held-out RMSE²
    ``loo_rmse_``, less the sampling noise of a mean), i.e. "how many samples is the learned score
    worth" (``_auto_prior_count``).

    ``prior`` names the text ranker (``learned``, or ``lm``: the fine-tuned policy, which starts
    from ``model_path``, the run's policy unless given); ``learned`` holds its keyword arguments.
    """

    name = "blend"
    needs_policy = True  # only used when prior == "lm"

    def __init__(self, decay: float = 1.0, space: str = "log", prior_count: float | str = "auto",
                 learned: dict | None = None, prior: str = "learned", model_path: str | None = None):
        from streamrl.ranker.base import make_ranker

        if prior not in ("learned", "lm"):
            raise ValueError(f"blend prior must be 'learned' or 'lm', got {prior!r}")
        super().__init__(decay=decay, space=space, prior=make_ranker(prior, policy_path=model_path, **(learned or {})),
                         prior_count=prior_count)

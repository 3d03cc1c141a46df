"""The output-length ranker interface (PAPER.md §3.6) and the factory that picks one by name.

A ranker maps prompts to estimated output lengths; only the order of the estimates matters
(dispatch puts the top α into the long-tail pool and admits longest-predicted first, §3.7).
Lifecycle during RL: ``make_ranker(name, **kwargs)``, ``fit`` once before training on (prompt,
length) pairs of this policy, ``score`` the dataset ahead (off the critical path), then
``update`` with each iteration's generations from a background thread (``ranker.online``).
Invariants: ``keys`` are stable prompt identities (the text itself when omitted); ``update`` may
run while ``score`` runs on another thread, so implementations build their new state aside and
swap it in under a lock, and ``score`` always sees a consistent model. Pure numpy/torch: no Ray,
no engine.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Sequence

import numpy as np

# name -> "module:Class"; imported on demand so the factory pulls in torch only when needed.
RANKERS = {
    "learned": "streamrl.ranker.learned:LearnedRanker",
    "learned-ridge": "streamrl.ranker.learned:RidgeRanker",
    "history": "streamrl.ranker.history:HistoryRanker",
    "blend": "streamrl.ranker.history:BlendRanker",
    "prompt-length": "streamrl.ranker.base:PromptLengthRanker",
    "lm": "streamrl.ranker.finetuned:FinetunedLMRanker",
    "reweighted": "streamrl.ranker.reweighted:ReweightedHistoryRanker",
}


def check_samples(texts: Sequence[str], lengths: Sequence[float] | None,
                  keys: Sequence[str] | None) -> tuple[list[str], np.ndarray | None, list[str]]:
    """Validate one batch of samples; returns (texts, lengths as float64, keys defaulting to texts)."""
    texts = list(texts)
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TypeError(f"texts[{i}] must be str, got {type(t).__name__}: {t!r:.80}")
    keys = texts if keys is None else [str(k) for k in keys]
    if len(keys) != len(texts):
        raise ValueError(f"keys and texts differ in length: {len(keys)} vs {len(texts)}")
    if lengths is None:
        return texts, None, keys
    lens = np.asarray(lengths, dtype=np.float64)
    if lens.shape != (len(texts),):
        raise ValueError(f"lengths must be 1-D with one value per text ({len(texts)}), got shape {lens.shape}")
    bad = np.flatnonzero(~np.isfinite(lens) | (lens < 0))
    if bad.size:
        raise ValueError(f"lengths must be finite and >= 0; bad at {bad[:5].tolist()}: {lens[bad[:5]].tolist()}")
    return texts, lens, keys


class Ranker(ABC):
    """Estimates output lengths of prompts; higher score = longer expected response.

    ``keys`` are a dataset index or a hash of the prompt. Rankers that remember per-prompt
    history (``history``, ``blend``) need them; text-only rankers (``learned``) ignore them
    except to group samples of one prompt."""

    name: str = "ranker"
    # Capabilities, declared here so callers never probe with getattr/hasattr.
    needs_policy: bool = False
    """It fine-tunes or runs a model: ``make_ranker`` hands it ``model_path`` (the policy)."""
    uses_traces: bool = False
    """It reads sampled responses (``observe``'s traces) and is given the sampling temperature."""
    rescore_all: bool = True
    """Its scores are cheap: the online table rescores every registered prompt after each refresh
    (False: scoring costs a policy pass per remembered response, so only what is asked for)."""
    scores_with_policy: bool = False
    """Its scores depend on the installed policy (``set_policy`` is called with each version)."""

    def set_policy(self, weights, version: int) -> None:
        """Install policy ``version`` (a state dict or a checkpoint path); rankers with
        ``scores_with_policy`` override it."""

    @abstractmethod
    def fit(self, texts: Sequence[str], lengths: Sequence[float], keys: Sequence[str] | None = None) -> "Ranker":
        """Train from scratch on (prompt, response length) pairs, one row per response. Returns self."""

    @abstractmethod
    def score(self, texts: Sequence[str], keys: Sequence[str] | None = None) -> np.ndarray:
        """Estimated output length per prompt (float64, shape ``(len(texts),)``)."""

    @abstractmethod
    def update(self, texts: Sequence[str], lengths: Sequence[float], keys: Sequence[str] | None = None) -> None:
        """Fold in one batch of recent generations (one RL iteration); cheap, thread-safe."""


class PromptLengthRanker(Ranker):
    """Baseline: the longer the prompt, the longer the answer (no training)."""

    name = "prompt-length"

    def fit(self, texts, lengths, keys=None) -> "PromptLengthRanker":
        check_samples(texts, lengths, keys)
        return self

    def score(self, texts, keys=None) -> np.ndarray:
        texts, _, _ = check_samples(texts, None, keys)
        return np.array([float(len(t)) for t in texts])

    def update(self, texts, lengths, keys=None) -> None:
        check_samples(texts, lengths, keys)


def make_ranker(name: str, policy_path: str | None = None, temperature: float | None = None, **kwargs) -> Ranker:
    """Build the ranker registered under ``name``; unknown names fail with the known ones listed.

    Rankers that fine-tune or run a model (``needs_policy``, e.g. ``lm``) start from
    ``policy_path`` unless their kwargs name a ``model_path``. Rankers that weigh sampled
    responses (``uses_traces``) get the sampling ``temperature`` unless their kwargs name one.
    """
    if name not in RANKERS:
        raise ValueError(f"unknown ranker {name!r}; known: {sorted(RANKERS)}")
    module_name, cls_name = RANKERS[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    if cls.needs_policy and kwargs.get("model_path") is None:
        kwargs["model_path"] = policy_path
    if cls.uses_traces and temperature is not None:
        kwargs.setdefault("temperature", temperature)
    return cls(**kwargs)

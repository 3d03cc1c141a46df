"""Simulated workloads: prompt lengths, true output lengths, and the ranker's predictions.

``Workload`` draws one iteration's ``Batch``: prompt lengths (log-normal, mean ``PROMPT_MEAN``,
capped at ``PROMPT_MAX``), output lengths from ``R1Lengths`` (the default: shaped like DeepSeek-R1
reasoning traces) or ``ReplayLengths`` (replayed from a file), and the ranker's predictions
(true length times log-normal noise of ``RANKER_SIGMA``; ``sigma=0`` is an oracle).

Invariant: the same generator state gives the same batch. Sources of the constants:
docs/simulator.md, "Constants". Data directory: ``$STREAMRL_DATA_DIR`` or ``../shared/data``
next to the repository root (``data_dir``).
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

# Fitted to PAPER.md §1's length scaling (1K -> 2K output multiplies training time by 1.6:
# (p + 2K) / (p + 1K) = 1.6), consistent with its "prompts < 1K".
PROMPT_MEAN = 670.0
PROMPT_SIGMA = 0.6
PROMPT_MAX = 5800  # PAPER.md §4: "mostly < 1K tokens, max ~5.8K"
# Chosen to give PAPER.md Table 4's top-20% / 10% recall (Qwen2.5-7B ranker: 0.87 / 0.82); top-5%
# comes out lower because ~5% of R1 samples tie at the cap. Checked in tests.
RANKER_SIGMA = 0.2
TOKENS_PER_WTOK = 1.4
"""Model tokens per whitespace token on these traces (data README: 1.2-1.75)."""


def data_dir() -> Path:
    env = os.environ.get("STREAMRL_DATA_DIR")
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[3].parent / "shared" / "data"


@dataclass(frozen=True)
class Batch:
    """One iteration's requests."""

    prompt_lens: np.ndarray
    out_lens: np.ndarray
    predicted: np.ndarray

    def __len__(self) -> int:
        return len(self.out_lens)

    @property
    def seq_lens(self) -> np.ndarray:
        return self.prompt_lens + self.out_lens


class R1Lengths:
    """Output lengths shaped like DeepSeek-R1 reasoning traces (PAPER.md §4: mode ~2K at a 20K
    cap, long tail to the cap), scaled proportionally for other caps: a log-normal with mode
    ``0.1 * cap`` and ``sigma = 0.9`` (median 0.22 cap, mean 0.3 cap, ~5% of samples hit the cap),
    clipped to ``[16, cap]``. The shape is our choice; the real long-CoT lengths in
    ``../shared/data/skythought_response_lengths.csv`` are similar (heavy tail, capped)."""

    def __init__(self, max_len: int, sigma: float = 0.9, mode_frac: float = 0.1) -> None:
        if max_len < 16:
            raise ValueError(f"max_len={max_len} must be >= 16 tokens")
        self.max_len, self.sigma = max_len, sigma
        self.mu = math.log(mode_frac * max_len) + sigma**2  # log-normal mode = exp(mu - sigma^2)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        x = rng.lognormal(self.mu, self.sigma, n)
        return np.clip(np.round(x), 16, self.max_len)

    def describe(self) -> str:
        return f"r1-lognormal(cap={self.max_len})"


class ReplayLengths:
    """Lengths replayed from a file (the SkyThought CSV's ``response_wtok`` column times
    ``TOKENS_PER_WTOK``, or a plain one-number-per-line file), resampled with replacement and
    scaled so the file's maximum maps to the cap (``scale=True``) or clipped to it."""

    def __init__(self, lengths: Sequence[float], max_len: int, scale: bool = True, name: str = "replay") -> None:
        arr = np.asarray([x for x in lengths if x > 0], dtype=float)
        if arr.size == 0:
            raise ValueError(f"no positive lengths to replay from {name}")
        self.base = arr * (max_len / arr.max()) if scale else arr
        self.max_len, self.name = max_len, name

    @classmethod
    def from_file(cls, path: str | Path, max_len: int, scale: bool = True, model_label: str | None = None) -> "ReplayLengths":
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"lengths file {p} not found (set STREAMRL_DATA_DIR or pass a path)")
        if p.suffix == ".csv":
            with p.open() as f:
                rows = [r for r in csv.DictReader(f) if model_label is None or model_label in r["model_label"]]
            lengths = [float(r["response_wtok"]) * TOKENS_PER_WTOK for r in rows]
        else:
            lengths = [float(line) for line in p.read_text().split() if line.strip()]
        return cls(lengths, max_len, scale, p.name)

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        return np.clip(np.round(rng.choice(self.base, n)), 1, self.max_len)

    def describe(self) -> str:
        return f"replay({self.name}, cap={self.max_len})"


@dataclass
class Workload:
    """Draws batches: ``num_prompts`` requests per iteration, output lengths from ``lengths``."""

    lengths: R1Lengths | ReplayLengths
    num_prompts: int = 1024
    ranker_sigma: float = RANKER_SIGMA
    prompt_mean: float = PROMPT_MEAN

    @property
    def max_len(self) -> int:
        return self.lengths.max_len

    def sample(self, rng: np.random.Generator, length_scale: float = 1.0) -> Batch:
        mu = math.log(self.prompt_mean) - PROMPT_SIGMA**2 / 2
        prompts = np.clip(np.round(rng.lognormal(mu, PROMPT_SIGMA, self.num_prompts)), 8, PROMPT_MAX)
        outs = np.clip(np.round(self.lengths.sample(self.num_prompts, rng) * length_scale), 1, None)
        noise = rng.lognormal(0.0, self.ranker_sigma, self.num_prompts) if self.ranker_sigma > 0 else 1.0
        return Batch(prompts, outs, outs * noise)


def r1_workload(max_len: int, num_prompts: int = 1024, ranker_sigma: float = RANKER_SIGMA) -> Workload:
    return Workload(R1Lengths(max_len), num_prompts, ranker_sigma)


def top_recall(true: Sequence[float], predicted: Sequence[float], frac: float) -> float:
    """Recall of the true longest ``frac`` among the predicted longest ``frac`` (PAPER.md Table 4)."""
    k = max(1, int(round(frac * len(true))))
    t = set(np.argsort(-np.asarray(true), kind="stable")[:k].tolist())
    p = set(np.argsort(-np.asarray(predicted), kind="stable")[:k].tolist())
    return len(t & p) / k

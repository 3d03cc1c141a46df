"""Length records, the rows every ranker is fitted and scored on, and their loaders.

A record is one response: ``(key, text, length, step)`` -- prompt identity, prompt text, output
length, and when it was generated (checkpoint / RL iteration; 0 for a static file), plus what a
rollout log adds (response, log-probs, versions). ``load_samples_jsonl`` reads a run's rollout
log (``metrics/samples.py``) or ``task stats --records``; the other loaders read the real data
files in ``../shared/data``. Keys of the real files are ``sha1(question)[:12]``, the key the
SkyThought CSV already uses, so prompts match across files. Nothing here imports a model, so the
SGS (``ranker.fit_file``) and the evaluation tool both read records through this module.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class LengthRecord:
    """One response of a policy to a prompt."""

    key: str
    """Stable prompt identity (dataset index or question hash); samples of one prompt share it."""
    text: str
    """The prompt text the ranker reads."""
    length: float
    """Output length (tokens or whitespace tokens; one unit per data set)."""
    step: int = 0
    """When it was generated: checkpoint or RL iteration, in order; 0 for a static file."""
    response: str | None = None
    """The response text (a rollout log row's ``response``), for rankers that read responses."""
    finish_reason: str | None = None
    """``stop`` (ended on EOS) or ``length`` (hit the token cap)."""
    logprob: float | None = None
    """Sum of the sampled tokens' log-probs under the generating policy (the rollout log's ``logprob``)."""
    version: int | None = None
    """Policy version that generated it (the rollout log's ``version_start``)."""
    token_logprobs: tuple[float, ...] | None = None
    """The same log-probs token by token (the rollout log's ``logprobs``), when it has them."""
    output_ids: tuple[int, ...] | None = None
    """The generated token ids (the rollout log's ``output_ids``), when it has them."""


def load_samples_jsonl(path: str | Path, step_field: str = "step") -> list[LengthRecord]:
    """Records from a JSONL of ``{"key", "text", "length", "step"}`` rows (the live-policy format).

    ``step_field`` names the column that orders the records (a run's rollout log,
    ``metrics/samples.py``, has ``iteration`` and ``epoch``); a missing ``step`` means 0, a missing
    column named otherwise is an error."""
    required = ("key", "text", "length") + (() if step_field == "step" else (step_field,))
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = [k for k in required if k not in row]
            if missing:
                raise ValueError(f"{path} line {line_no}: missing fields {missing} in {sorted(row)}")
            out.append(LengthRecord(str(row["key"]), str(row["text"]), float(row["length"]), int(row.get(step_field, 0)),
                                    response=row.get("response"), finish_reason=row.get("finish_reason"),
                                    logprob=None if row.get("logprob") is None else float(row["logprob"]),
                                    version=None if row.get("version_start") is None else int(row["version_start"]),
                                    token_logprobs=None if row.get("logprobs") is None else tuple(row["logprobs"]),
                                    output_ids=None if row.get("output_ids") is None else tuple(row["output_ids"])))
    if not out:
        raise ValueError(f"{path}: no records")
    return out


# -- real data files (README in the data dir) --------------------------------------------------
QWEN_MATH_FILE = "qwen25math_math_cot_100.jsonl"
SKYTHOUGHT_CSV = "skythought_response_lengths.csv"
AIME_FILE = "skythought_sky-t1-math-correct-5k-32b_ckpt140_aime24.jsonl"
MATH500_FILE = "math500_test.jsonl"
CKPT_RUN = "Sky-T1-math-correct-5K-32B-ckpts/checkpoint-"


def question_key(question: str) -> str:
    """The SkyThought CSV's ``question_sha1_12``."""
    return hashlib.sha1(question.encode()).hexdigest()[:12]


def _jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_qwen_math(data_dir: Path) -> list[LengthRecord]:
    """100 MATH prompts x 8 Qwen2.5-Math responses; length in whitespace tokens."""
    out = []
    for line_no, row in enumerate(_jsonl(data_dir / QWEN_MATH_FILE), 1):
        responses = row.get("code")
        if not isinstance(responses, list) or not all(isinstance(x, str) for x in responses):
            raise ValueError(f"{QWEN_MATH_FILE} line {line_no}: 'code' must be a list of responses, got {type(responses).__name__}")
        key = question_key(row["question"])
        out.extend(LengthRecord(key, row["question"], float(len(x.split()))) for x in responses)
    return out


def _texts_by_key(path: Path, field: str) -> dict[str, str]:
    return {question_key(row[field]): row[field] for row in _jsonl(path)}


def _csv_rows(data_dir: Path) -> list[dict]:
    with open(data_dir / SKYTHOUGHT_CSV, newline="") as f:
        return list(csv.DictReader(f))


def _with_text(rows: list[dict], texts: dict[str, str], step_of: Callable[[dict], int]) -> list[LengthRecord]:
    missing = sorted({r["question_sha1_12"] for r in rows} - set(texts))
    if missing:
        raise ValueError(f"{len(missing)} CSV prompts have no question text, e.g. {missing[:3]}")
    return [LengthRecord(r["question_sha1_12"], texts[r["question_sha1_12"]], float(r["response_wtok"]), step_of(r))
            for r in rows]


def load_skythought_checkpoints(data_dir: Path) -> list[LengthRecord]:
    """The 30 AIME24 prompts under the 11 checkpoints of Sky-T1-32B; step = checkpoint number."""
    rows = [r for r in _csv_rows(data_dir) if r["dataset"] == "aime24" and CKPT_RUN in r["source_path"]]
    if not rows:
        raise ValueError(f"{SKYTHOUGHT_CSV}: no aime24 rows with {CKPT_RUN!r} in source_path")

    def step_of(r: dict) -> int:
        return int(re.search(re.escape(CKPT_RUN) + r"(\d+)", r["source_path"]).group(1))

    return _with_text(rows, _texts_by_key(data_dir / AIME_FILE, "question"), step_of)


def load_skythought_math500(data_dir: Path) -> dict[str, list[LengthRecord]]:
    """MATH-500 responses per model (one greedy response per prompt), text from the MATH-500 file."""
    texts = _texts_by_key(data_dir / MATH500_FILE, "problem")
    by_model: dict[str, list[dict]] = defaultdict(list)
    for r in _csv_rows(data_dir):
        if r["dataset"] == "math500":
            by_model[r["model_label"].split("/")[-1]].append(r)
    return {m: _with_text(rows, texts, lambda r: 0) for m, rows in sorted(by_model.items())}


def require_files(data_dir: Path, *names: str) -> None:
    missing = [n for n in names if not (data_dir / n).exists()]
    if missing:
        raise FileNotFoundError(f"data files missing in {data_dir}: {missing} (set $STREAMRL_DATA_DIR or --data-dir)")

"""Math tasks: GSM8K / MATH-500 style prompt files (jsonl or parquet) with ``math_verify`` rewards.

    file (.jsonl | .parquet) --read_rows--> (line, dict) --_row_to_item--> MathItem
        --MathTask split(seed)--> train / eval Prompts --MathTask.reward--> 1.0 | 0.0

Invariants: a bad row either raises ``DataError`` naming file, line and field
(``on_bad_row="raise"``) or is counted in the ``LoadReport`` and logged (``"skip"``); a file
with no usable row always raises (``load_math_items``). ``math_verify`` is imported on first use
only and runs with its own ``signal.alarm`` timeouts disabled (they fail outside the main
thread): run the reward through ``RewardRunner`` (isolated mode), which enforces the timeout.
Row formats: ``_row_to_item``; how an answer is found and compared: ``math_reward``.
"""

from __future__ import annotations

import functools
import logging
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from streamrl.errors import UserError
from streamrl.tasks.base import LoadReport, Task, default_data_dir
from streamrl.types import Prompt

log = logging.getLogger(__name__)

Format = Literal["gsm8k", "math500", "auto"]
FORMATS = ("gsm8k", "math500", "auto")
DEFAULT_FILES = {"gsm8k": "gsm8k_test.jsonl", "math500": "math500_test.jsonl"}
DEFAULT_TEMPLATE = (
    "Solve the following math problem step by step. "
    "Put the final answer in \\boxed{{}}.\n\nProblem: {problem}\n\nSolution:"
)
MAX_ANSWER_CHARS = 1000
"""Longer extracted answers are treated as garbage (score 0) rather than handed to sympy."""

_GSM8K_FINAL = re.compile(r"####\s*(-?[\d,]*\.?\d+)\s*$")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_NUMBER = re.compile(r"-?\d+(?:,\d{3})*(?:\.\d+)?")


class DataError(UserError, ValueError):
    """A task data file is unusable; the message names the file, line and field."""


@dataclass(frozen=True)
class RowSpec:
    """Which columns hold the prompt and the reference answer, and how the answer is read."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    extractor: Literal["gsm8k", "boxed", "raw"] = "raw"


@dataclass(frozen=True)
class MathItem:
    """One validated row."""

    line: int
    problem: str
    answer: str
    meta: dict[str, Any]


# ----------------------------------------------------------------------------- reading rows


def read_rows(path: Path, split: str = "train") -> Iterator[tuple[int, dict[str, Any] | str]]:
    """Yield ``(line, row)`` for each row, or ``(line, reason)`` for a row that cannot be decoded.
    A directory is a ``datasets`` ``save_to_disk`` one (a DatasetDict gives its ``split``)."""
    suffix = path.suffix.lower()
    if path.is_dir():
        yield from _read_datasets_dir(path, split)
    elif suffix == ".parquet":
        yield from _read_parquet(path)
    elif suffix in (".jsonl", ".json"):
        yield from _read_jsonl(path)
    elif suffix == ".csv":
        yield from _read_csv(path)
    else:
        raise DataError(f"{path}: unsupported file type {suffix!r} (expected .jsonl, .parquet, .csv or a "
                        "`datasets` directory)")


def _read_csv(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    import csv

    try:
        with open(path, newline="", encoding="utf-8") as f:
            for i, row in enumerate(csv.DictReader(f), start=2):  # line 1 is the header
                if None in row:
                    yield i, f"row has more fields than the header ({len(row) - 1 + len(row[None])})"
                    continue
                yield i, row
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: invalid UTF-8 ({exc.reason} at byte {exc.start})") from None


def _read_datasets_dir(path: Path, split: str) -> Iterator[tuple[int, dict[str, Any] | str]]:
    try:
        import datasets
    except ImportError:
        raise DataError(f"{path}: reading a `datasets` directory needs the datasets package: "
                        "pip install 'streamrl[datasets]'") from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as exc:
        raise DataError(f"{path}: not a `datasets` save_to_disk directory: {type(exc).__name__}: {exc}") from None
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise DataError(f"{path}: split {split!r} not in the DatasetDict (splits: {sorted(data)})")
        data = data[split]
    for i, row in enumerate(data, start=1):
        yield i, dict(row)


def _read_jsonl(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield line_no, f"invalid UTF-8 ({exc.reason} at byte {exc.start})"
                continue
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as exc:
                yield line_no, f"invalid JSON ({exc.msg} at column {exc.colno}): {_short(text)}"
                continue
            if not isinstance(row, dict):
                yield line_no, f"expected a JSON object, got {type(row).__name__}: {_short(text)}"
                continue
            yield line_no, row


def _read_parquet(path: Path) -> Iterator[tuple[int, dict[str, Any] | str]]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise DataError(f"{path}: cannot read parquet file: {type(exc).__name__}: {exc}") from exc
    for i, row in enumerate(table.to_pylist(), start=1):
        yield i, row


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value) if not isinstance(value, str) else value.strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _field(row: dict[str, Any], name: str) -> str:
    """The non-empty string ``row[name]``; raises ``ValueError`` naming the field otherwise."""
    if name not in row:
        raise ValueError(f"missing field {name!r} (row has {sorted(row)})")
    value = row[name]
    if not isinstance(value, str):
        raise ValueError(f"field {name!r} must be a string, got {type(value).__name__}: {_short(value)}")
    if not value.strip():
        raise ValueError(f"field {name!r} is empty")
    return value


def _spec_item(line: int, row: dict[str, Any], spec: RowSpec) -> MathItem:
    value = row.get(spec.answer_key)
    if isinstance(value, (int, float)) and not isinstance(value, bool):  # numeric answers in csv/parquet
        row = {**row, spec.answer_key: str(value)}
    prompt, answer = _field(row, spec.prompt_key), _field(row, spec.answer_key)
    if spec.extractor == "gsm8k":
        match = _GSM8K_FINAL.search(answer)
        if match is None:
            raise ValueError(f"field {spec.answer_key!r} does not end in '#### <number>': {_short(answer[-80:])}")
        answer = match.group(1).replace(",", "")
    elif spec.extractor == "boxed":
        boxed = last_boxed(answer)
        if not boxed:
            raise ValueError(f"field {spec.answer_key!r} has no \\boxed{{}} answer: {_short(answer[-80:])}")
        answer = boxed
    meta: dict[str, Any] = {k: v for k, v in row.items()
                            if k not in (spec.prompt_key, spec.answer_key) and isinstance(v, (str, int, float, bool))}
    return MathItem(line, prompt, answer.strip(), meta)


def _row_to_item(line: int, row: dict[str, Any], fmt: "Format | RowSpec") -> MathItem:
    """Validate one row; raises ``ValueError`` with the reason (naming the field) if it is bad.

    ``"gsm8k"`` needs ``question`` and ``answer`` (a solution ending in ``#### N``; the gold is
    ``N`` without thousands commas); ``"math500"`` needs ``problem`` and ``answer`` (or, lacking
    ``answer``, a ``solution`` with a ``\\boxed{}``); ``"auto"`` picks per row by which question
    field is present."""
    if isinstance(fmt, RowSpec):
        return _spec_item(line, row, fmt)
    if fmt == "auto":
        if "question" in row:
            fmt = "gsm8k"
        elif "problem" in row:
            fmt = "math500"
        else:
            raise ValueError(f"missing field 'question' (gsm8k) or 'problem' (math500) (row has {sorted(row)})")
    if fmt == "gsm8k":
        question, solution = _field(row, "question"), _field(row, "answer")
        match = _GSM8K_FINAL.search(solution)
        if match is None:
            raise ValueError(f"field 'answer' does not end in '#### <number>': {_short(solution[-80:])}")
        return MathItem(line, question, match.group(1).replace(",", ""), {"format": "gsm8k"})
    problem = _field(row, "problem")
    if "answer" in row or "solution" not in row:
        answer = _field(row, "answer").strip()
    else:
        answer = last_boxed(_field(row, "solution")) or ""
        if not answer:
            raise ValueError("missing field 'answer' and field 'solution' has no \\boxed{} answer")
    meta: dict[str, Any] = {"format": "math500"}
    for key in ("subject", "level", "unique_id"):
        if isinstance(row.get(key), (str, int, float)):
            meta[key] = row[key]
    return MathItem(line, problem, answer, meta)


def load_math_items(
    path: str | Path,
    fmt: "Format | RowSpec" = "auto",
    on_bad_row: Literal["skip", "raise"] = "skip",
    check_prompt: Callable[[MathItem], str | None] | None = None,
    split: str = "train",
) -> tuple[list[MathItem], LoadReport]:
    """Read and validate every row of ``path``.

    ``check_prompt(item)`` may return a reason to reject the row (e.g. too many tokens).
    Raises ``DataError`` for a missing/unreadable/empty file, for a bad row under
    ``on_bad_row="raise"``, and when no row is usable. A bad row: invalid JSON or UTF-8, not an
    object, a missing, non-string or empty field, no final answer, a prompt over
    ``max_prompt_tokens``. Blank lines are not rows.
    """
    if not isinstance(fmt, RowSpec) and fmt not in FORMATS:
        raise ValueError(f"fmt must be one of {FORMATS} or a RowSpec, got {fmt!r}")
    if on_bad_row not in ("skip", "raise"):
        raise ValueError(f"on_bad_row must be 'skip' or 'raise', got {on_bad_row!r}")
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file does not exist")
    report = LoadReport(str(path))
    items: list[MathItem] = []
    for line, row in read_rows(path, split):
        report.rows_read += 1
        try:
            if isinstance(row, str):
                raise ValueError(row)
            item = _row_to_item(line, row, fmt)
            reason = check_prompt(item) if check_prompt else None
            if reason:
                raise ValueError(reason)
        except ValueError as exc:
            if on_bad_row == "raise":
                raise DataError(f"{path}:{line}: {exc}") from None
            report.skip(line, str(exc))
            continue
        items.append(item)
    report.rows_kept = len(items)
    if report.rows_read == 0:
        raise DataError(f"{path}: file has no rows")
    if not items:
        raise DataError(f"{path}: no usable rows; {report.summary()}")
    return items, report


# ----------------------------------------------------------------------------- answers


def last_boxed(text: str, tries: int = 3) -> str | None:
    """Content of the last complete ``\\boxed{...}`` in ``text`` (looking at most ``tries`` back)."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    for start in reversed(starts[-tries:]):
        depth, end = 1, min(len(text), start + MAX_ANSWER_CHARS + 1)
        for i in range(start, end):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:i].strip()
                    if content:
                        return content
                    break
    return None


def extract_final_answer(response: str) -> tuple[Literal["boxed", "number"], str] | None:
    """The response's final answer: its last ``\\boxed{}`` content, else its last number."""
    boxed = last_boxed(response)
    if boxed is not None:
        return "boxed", boxed
    last = None
    for last in _NUMBER.finditer(response):
        pass
    return ("number", last.group(0).replace(",", "")) if last is not None else None


@functools.lru_cache(maxsize=1)
def _mv() -> Any:
    """``math_verify``, imported on first use only: its import is slow (sympy included)."""
    import math_verify
    import math_verify.grader
    import math_verify.parser

    # We disable math_verify's signal-based timeouts on purpose (RewardRunner enforces one);
    # silence its one-off warning about that.
    math_verify.parser.TIMEOUT_WARNING_SHOWN = True
    math_verify.grader.TIMEOUT_WARNING_SHOWN = True
    return math_verify


@functools.lru_cache(maxsize=4096)
def _parse_gold(answer: str) -> list[Any]:
    mv = _mv()
    config = [mv.LatexExtractionConfig(boxed_match_priority=0), mv.ExprExtractionConfig()]
    gold = mv.parse(f"\\boxed{{{answer}}}", config, parsing_timeout=None)
    if not gold:
        raise ValueError(f"math_verify cannot parse the gold answer {answer!r}")
    return gold


def math_reward(prompt: Prompt, response: str) -> float:
    """1.0 if the response's final answer equals ``prompt.answer`` (per ``math_verify``), else 0.0.

    The final answer is the response's last complete ``\\boxed{...}`` (or ``\\fbox``), else its
    last number; both are length-capped (``MAX_ANSWER_CHARS``), so garbage costs little and
    scores 0. It is compared with the gold by ``math_verify.parse`` / ``verify``."""
    gold = _parse_gold(prompt.answer)
    found = extract_final_answer(response) if isinstance(response, str) else None
    if found is None or len(found[1]) > MAX_ANSWER_CHARS:
        return 0.0
    mv = _mv()
    kind, text = found
    if kind == "boxed":
        pred = mv.parse(f"\\boxed{{{text}}}", [mv.LatexExtractionConfig(boxed_match_priority=0)], parsing_timeout=None)
    else:
        pred = mv.parse(text, [mv.ExprExtractionConfig()], parsing_timeout=None)
    if not pred:
        return 0.0
    return 1.0 if mv.verify(gold, pred, timeout_seconds=None) else 0.0


def verify(response: str, answer: str, prompt: str, metadata: dict) -> float:
    """``math_reward`` in the user-reward signature, to name by path or combine with your own:
    ``task.reward: [streamrl.tasks.math:verify, my_reward.py:format_bonus]``."""
    return math_reward(Prompt("verify", prompt, answer, dict(metadata)), response)


# ----------------------------------------------------------------------------- the task


PRESETS: dict[str, tuple[Format, str]] = {"gsm8k": ("gsm8k", "gsm8k"), "math500": ("math500", "math500")}
"""Preset -> (row format, file stem in the data directory: <stem>_train.jsonl, else <stem>_test.jsonl)."""


def resolve_data_path(path: str | Path | None, name: str, role: str = "train") -> Path:
    """``path`` as given if it exists, else relative to ``default_data_dir()``; None -> the preset's
    file: ``<stem>_train.jsonl`` where the data directory has it, else ``<stem>_test.jsonl`` (with a
    warning that training reads the test split)."""
    if path is None:
        if name not in PRESETS:
            raise DataError(f"task {name!r} needs task.train_path (a .jsonl, .parquet, .csv file or a "
                            "`datasets` directory)")
        stem = PRESETS[name][1]
        train = default_data_dir() / f"{stem}_train.jsonl"
        if train.is_file():
            return train
        if role == "train":
            log.warning("task %s: no %s in %s; training and held-out prompts are cut from %s_test.jsonl "
                        "(set task.train_path / task.eval_path)", name, train.name, default_data_dir(), stem)
        return default_data_dir() / f"{stem}_test.jsonl"
    p = Path(path)
    if p.exists() or p.is_absolute():
        return p
    return default_data_dir() / p


class MathTask(Task):
    """Prompts from a data file with a reference answer per row (``task.name: file`` and its
    presets gsm8k / math500). Held-out prompts come from ``eval_path`` when given, else ``num_eval``
    rows are cut from the training file by seed (disjoint from the training rows)."""

    def __init__(
        self,
        path: str | Path,
        *,
        name: str = "math",
        fmt: "Format | RowSpec" = "auto",
        num_train: int = 4096,
        num_eval: int = 256,
        seed: int = 0,
        on_bad_row: Literal["skip", "raise"] = "skip",
        template: str = DEFAULT_TEMPLATE,
        max_prompt_tokens: int | None = None,
        count_tokens: Callable[[str], int] | None = None,
        eval_path: str | Path | None = None,
        train_split: str = "train",
        eval_split: str = "test",
    ):
        if "{problem}" not in template and "{prompt}" not in template:
            raise ValueError(f"template must contain '{{prompt}}', got {template!r}")
        if num_train < 1 or num_eval < 1:
            raise ValueError(f"num_train and num_eval must be >= 1, got {num_train} and {num_eval}")
        self.name = name
        self.path = Path(path)
        self.template = template

        def check_prompt(item: MathItem) -> str | None:
            text = self._render(item.problem, item.meta)  # a template column the row lacks rejects the row
            if count_tokens is None or max_prompt_tokens is None:
                return None
            n = count_tokens(text)
            return f"prompt has {n} tokens > max_prompt_tokens={max_prompt_tokens}" if n > max_prompt_tokens else None

        items, self._report = load_math_items(self.path, fmt, on_bad_row, check_prompt, split=train_split)
        order = list(range(len(items)))
        random.Random(seed).shuffle(order)
        if eval_path is not None:
            eval_items, eval_report = load_math_items(eval_path, fmt, on_bad_row, check_prompt, split=eval_split)
            self._eval_report: LoadReport | None = eval_report
            self._eval = [self._prompt(it, "eval") for it in eval_items[:num_eval]]
            self._train = [self._prompt(items[i]) for i in order[:num_train]]
            return
        self._eval_report = None
        if num_eval >= len(items):
            raise DataError(f"{self.path}: num_eval={num_eval} leaves no training rows ({len(items)} usable rows)")
        prompts = [self._prompt(items[i]) for i in order]
        self._eval = prompts[:num_eval]
        self._train = prompts[num_eval : num_eval + num_train]

    @classmethod
    def from_config(cls, cfg: Any, seed: int = 0, count_tokens: Callable[[str], int] | None = None) -> "MathTask":
        """Build from a ``TaskConfig`` (name file | gsm8k | math500)."""
        fmt: Format | RowSpec
        if cfg.prompt_key or cfg.answer_key or cfg.answer_extractor or cfg.name not in PRESETS:
            preset = {"gsm8k": RowSpec("question", "answer", "gsm8k"), "math500": RowSpec("problem", "answer", "raw")}
            base = preset.get(cfg.name, RowSpec())
            fmt = RowSpec(cfg.prompt_key or base.prompt_key, cfg.answer_key or base.answer_key,
                          cfg.answer_extractor or base.extractor)
        else:
            fmt = PRESETS[cfg.name][0]
        template = cfg.prompt_template or (DEFAULT_TEMPLATE if cfg.name in PRESETS else "{prompt}")
        eval_path = resolve_data_path(cfg.eval_path, cfg.name, "eval") if cfg.eval_path else None
        return cls(
            resolve_data_path(cfg.train_path, cfg.name),
            name=cfg.name,
            fmt=fmt,
            num_train=cfg.num_train,
            num_eval=cfg.num_eval,
            seed=seed,
            on_bad_row=cfg.on_bad_row,
            template=template,
            max_prompt_tokens=cfg.max_prompt_tokens,
            count_tokens=count_tokens,
            eval_path=eval_path,
            train_split=cfg.train_split,
            eval_split=cfg.eval_split,
        )

    def _render(self, problem: str, meta: dict[str, Any]) -> str:
        fields = {k: v for k, v in meta.items() if isinstance(v, str)}
        try:
            return self.template.format_map({**fields, "prompt": problem, "problem": problem})
        except KeyError as exc:
            raise ValueError(f"task.prompt_template names {{{exc.args[0]}}}, which the row does not have "
                             f"(row has {sorted(fields)})") from None

    def _prompt(self, item: MathItem, role: str = "") -> Prompt:
        meta = dict(item.meta, line=item.line, problem=item.problem)
        tag = f"{self.name}-{role}" if role else self.name
        return Prompt(f"{tag}-{item.line:06d}", self._render(item.problem, item.meta), item.answer, meta)

    def train_prompts(self) -> list[Prompt]:
        return list(self._train)

    def eval_prompts(self) -> list[Prompt]:
        return list(self._eval)

    def reward(self, prompt: Prompt, response: str) -> float:
        return math_reward(prompt, response)

    def load_report(self) -> LoadReport:
        return self._report

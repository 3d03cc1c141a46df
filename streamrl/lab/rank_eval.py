"""Train-and-evaluate protocols for output-length rankers, on any list of ``LengthRecord``.

A record is one response: ``(key, text, length, step)``: prompt identity, prompt text, output
length, and when it was generated (checkpoint / RL iteration; 0 for a static file). Loaders at
``ranker/records.py`` turn the real data files and rollout logs into records. Protocols:
``prompt_folds``, ``sample_folds``, ``streaming`` and ``transfer``; ``evaluate`` runs one.

Invariants: no evaluation sample is ever seen in training; scores are compared only within one
batch (ranking only matters within one dispatch batch); beside each ranker every protocol
reports reference rows (``reference_rows``: ceiling, oracle, random), per sample and per prompt
group (``UNITS``; ``group_metrics``).
"""

from __future__ import annotations

import random as _random
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from streamrl.ranker.base import Ranker, make_ranker
from streamrl.ranker.metrics import DEFAULT_FRACS, ceiling_scores, rank_metrics
from streamrl.ranker.records import (AIME_FILE, MATH500_FILE, QWEN_MATH_FILE, SKYTHOUGHT_CSV, LengthRecord, load_qwen_math, load_samples_jsonl,
                                     load_skythought_checkpoints, load_skythought_math500, require_files)

METRIC_KEYS = tuple(f"recall@{f * 100:g}%" for f in DEFAULT_FRACS) + ("spearman",)
UNITS = ("sample", "group-mean", "group-max")
_REDUCE = {"group-mean": np.mean, "group-max": np.max}


@dataclass
class Prediction:
    """Scores for one evaluation batch, and which records the ranker could have seen before it."""

    batch: str
    records: list[LengthRecord]
    scores: np.ndarray
    seen: list[LengthRecord]


def _traces(ranker: Ranker, recs: Sequence[LengthRecord]) -> dict:
    """``{"traces": ...}`` for a ranker that reads responses (``uses_traces``), else ``{}``.

    A record without a logged response (text or ids) or log-prob gives ``None`` (its length counts,
    unweighted)."""
    if not ranker.uses_traces:
        return {}
    return {"traces": [None if r.logprob is None or (r.response is None and r.output_ids is None)
                       else ranker.trace_of(r.response, r.finish_reason or "length", r.logprob, r.token_logprobs,
                                            r.output_ids) for r in recs]}


def _fit(factory: Callable[[], Ranker], recs: Sequence[LengthRecord]) -> Ranker:
    ranker = factory()
    return ranker.fit([r.text for r in recs], [r.length for r in recs], [r.key for r in recs], **_traces(ranker, recs))


def _score(ranker: Ranker, recs: Sequence[LengthRecord]) -> np.ndarray:
    return ranker.score([r.text for r in recs], [r.key for r in recs])


def prompt_folds(records: Sequence[LengthRecord], factory: Callable[[], Ranker], k: int = 5,
                 seed: int = 0) -> list[Prediction]:
    """k-fold by prompt key: the ranker never saw the evaluation prompts. Each fold is one batch
    (scores of models trained on different folds are never compared)."""
    keys = sorted({r.key for r in records})
    if len(keys) < k:
        raise ValueError(f"need at least k={k} prompts for prompt folds, got {len(keys)}")
    _random.Random(seed).shuffle(keys)
    fold_of = {key: i % k for i, key in enumerate(keys)}
    out = []
    for fold in range(k):
        train = [r for r in records if fold_of[r.key] != fold]
        test = [r for r in records if fold_of[r.key] == fold]
        out.append(Prediction(f"fold {fold}", test, _score(_fit(factory, train), test), train))
    return out


def sample_folds(records: Sequence[LengthRecord], factory: Callable[[], Ranker], k: int = 2,
                 seed: int = 0) -> list[Prediction]:
    """Split each prompt's samples into k folds; the ranker trains on the other folds of *all*
    prompts (RL's "same prompt, earlier epoch"). One batch per fold."""
    by_key: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(records):
        by_key[r.key].append(i)
    small = {key: len(ix) for key, ix in by_key.items() if len(ix) < k}
    if small:
        raise ValueError(f"sample folds need >= k={k} samples per prompt; short prompts: {dict(list(small.items())[:5])}")
    rng = _random.Random(seed)
    fold = np.empty(len(records), dtype=int)
    for key in sorted(by_key):
        ix = list(by_key[key])
        rng.shuffle(ix)
        for j, i in enumerate(ix):
            fold[i] = j % k
    out = []
    for f in range(k):
        train = [r for r, g in zip(records, fold) if g != f]
        test = [r for r, g in zip(records, fold) if g == f]
        out.append(Prediction(f"fold {f}", test, _score(_fit(factory, train), test), train))
    return out


def streaming(records: Sequence[LengthRecord], factory: Callable[[], Ranker], warmup_steps: int = 1,
              policy_at: Callable[[int], tuple[str, int] | None] | None = None) -> list[Prediction]:
    """Fit on the first ``warmup_steps`` steps; then score each later step, evaluate, and
    ``update`` with it (exactly the online refresh during RL). Metrics per step, averaged
    weighted by the step's size: ranking only matters within one dispatch batch.

    ``policy_at(version)``: for rankers that score with the current policy (``set_policy``), the
    checkpoint ``(path, version)`` to install before a step whose records were generated by
    ``version`` (their smallest ``version``), or None to keep the installed one."""
    steps = sorted({r.step for r in records})
    if len(steps) <= warmup_steps:
        raise ValueError(f"streaming needs more than warmup_steps={warmup_steps} steps, got steps {steps}")
    seen = [r for r in records if r.step in steps[:warmup_steps]]
    ranker = _fit(factory, seen)
    installed = None
    out = []
    for step in steps[warmup_steps:]:
        batch = [r for r in records if r.step == step]
        versions = [r.version for r in batch if r.version is not None]
        if policy_at is not None and versions and ranker.scores_with_policy:
            ckpt = policy_at(min(versions))
            if ckpt is not None and ckpt != installed:
                ranker.set_policy(*ckpt)
                installed = ckpt
        out.append(Prediction(f"step {step}", batch, _score(ranker, batch), list(seen)))
        ranker.update([r.text for r in batch], [r.length for r in batch], [r.key for r in batch], **_traces(ranker, batch))
        seen.extend(batch)
    return out


def checkpoint_resolver(folder: str | Path, lag: int = 1) -> Callable[[int], tuple[str, int] | None]:
    """``policy_at`` for ``streaming`` from a run's kept checkpoints (``run.keep_checkpoints``).

    ``folder`` holds ``iter-<k>`` policies (version k: the policy after k training iterations).
    A batch generated by version v is scored with the newest kept version <= v - ``lag``: the live
    ranker scores the next batch ahead, under the policy one version older than the one that
    generates it (``lag=1``)."""
    folder = Path(folder)
    kept = sorted((int(p.name.split("-", 1)[1]), str(p)) for p in folder.glob("iter-*")
                  if p.name.split("-", 1)[1].isdigit() and (p / "config.json").is_file())
    if not kept:
        raise FileNotFoundError(f"no iter-<k> policy checkpoints in {str(folder)!r} (train with run.keep_checkpoints=true)")
    if lag < 0:
        raise ValueError(f"lag must be >= 0, got {lag}")

    def policy_at(version: int) -> tuple[str, int] | None:
        usable = [(path, k) for k, path in kept if k <= version - lag]
        return usable[-1] if usable else None

    return policy_at


def transfer(train: Sequence[LengthRecord], test: Sequence[LengthRecord], factory: Callable[[], Ranker]) -> list[Prediction]:
    """Fit on one record set, score another (e.g. another model's lengths on other prompts): one
    pooled batch; the two must share no prompt key."""
    overlap = {r.key for r in train} & {r.key for r in test}
    if overlap:
        raise ValueError(f"transfer train and test share {len(overlap)} prompt keys, e.g. {sorted(overlap)[:3]}")
    return [Prediction("pooled", list(test), _score(_fit(factory, train), test), list(train))]


def batch_metrics(preds: Iterable[Prediction], scores_of: Callable[[Prediction], np.ndarray]) -> dict[str, float]:
    """Metrics per batch (predictions with the same ``batch`` are pooled), averaged by batch size."""
    pooled: dict[str, tuple[list[float], list[float]]] = defaultdict(lambda: ([], []))
    for p in preds:
        lens, scores = pooled[p.batch]
        lens.extend(r.length for r in p.records)
        scores.extend(np.asarray(scores_of(p), dtype=np.float64).tolist())
    total = sum(len(v[0]) for v in pooled.values())
    out = {m: 0.0 for m in METRIC_KEYS}
    for lens, scores in pooled.values():
        for m, v in rank_metrics(lens, scores).items():
            out[m] += v * len(lens) / total
    out["n"] = total
    out["batches"] = len(pooled)
    return out


def _weighted_metrics(batches: list[tuple[Sequence[float], Sequence[float]]]) -> dict[str, float]:
    """rank_metrics of each (truth, scores) batch with two or more entries, averaged by size."""
    batches = [(t, s) for t, s in batches if len(t) >= 2]
    total = sum(len(t) for t, _ in batches)
    out = {m: (0.0 if total else float("nan")) for m in METRIC_KEYS}
    for truth, scores in batches:
        for m, v in rank_metrics(truth, scores).items():
            out[m] += v * len(truth) / total
    out["n"] = total
    out["batches"] = len(batches)
    return out


def _groups(preds: Iterable[Prediction], scores_of: Callable[[Prediction], np.ndarray]
            ) -> dict[str, dict[str, tuple[list[LengthRecord], list[float]]]]:
    """batch -> prompt key -> (that prompt's records in the batch, their scores)."""
    out: dict[str, dict[str, tuple[list, list]]] = defaultdict(lambda: defaultdict(lambda: ([], [])))
    for p in preds:
        for r, s in zip(p.records, np.asarray(scores_of(p), dtype=np.float64).tolist()):
            recs, scores = out[p.batch][r.key]
            recs.append(r)
            scores.append(s)
    return out


def _reducer(unit: str) -> Callable:
    if unit not in _REDUCE:
        raise ValueError(f"unknown group unit {unit!r}; known: {sorted(_REDUCE)}")
    return _REDUCE[unit]


def group_metrics(preds: Iterable[Prediction], scores_of: Callable[[Prediction], np.ndarray],
                  unit: str) -> dict[str, float]:
    """Metrics over prompt groups (``unit`` ``group-mean`` / ``group-max``).

    Unit ``sample`` ranks every response on its own. GRPO dispatches the group of one prompt's
    samples, so each row is also computed per group within a batch: truth the mean
    (``group-mean``) or max (``group-max``) of their lengths, score the mean of their scores;
    ``n`` counts groups, and a batch with fewer than two is left out."""
    reduce = _reducer(unit)
    return _weighted_metrics([([float(reduce([r.length for r in recs])) for recs, _ in groups.values()],
                               [float(np.mean(scores)) for _, scores in groups.values()])
                              for groups in _groups(preds, scores_of).values()])


def group_oracle(preds: Sequence[Prediction], all_records: Sequence[LengthRecord], unit: str) -> dict:
    """The group-level oracle row: ``oracle (other samples)`` (the prompt's samples outside the
    group) where every group has some, else ``oracle (half vs half)`` (one alternate half of a
    group ranks the other; noisier truth, so a lower bound on the group-level noise ceiling)."""
    reduce = _reducer(unit)
    groups = _groups(preds, lambda p: np.zeros(len(p.records)))
    by_key: dict[str, list[LengthRecord]] = defaultdict(list)
    for r in all_records:
        by_key[r.key].append(r)
    outside: dict[tuple[str, str], list[float]] = {}
    for batch, gs in groups.items():
        for key, (recs, _) in gs.items():
            inside = {id(r) for r in recs}
            outside[batch, key] = [r.length for r in by_key[key] if id(r) not in inside]
    if all(outside.values()):
        return {"ranker": "oracle (other samples)",
                **_weighted_metrics([([float(reduce([r.length for r in recs])) for recs, _ in gs.values()],
                                      [float(np.mean(outside[batch, key])) for key in gs])
                                     for batch, gs in groups.items()])}
    halves = [[(recs[0::2], recs[1::2]) for recs, _ in gs.values() if len(recs) >= 2] for gs in groups.values()]
    directions = [_weighted_metrics([([float(reduce([r.length for r in pair[1 - a]])) for pair in batch],
                                      [float(np.mean([r.length for r in pair[a]])) for pair in batch])
                                     for batch in halves]) for a in (0, 1)]
    return {"ranker": "oracle (half vs half)", **{m: (directions[0][m] + directions[1][m]) / 2 for m in METRIC_KEYS},
            "n": directions[0]["n"], "batches": directions[0]["batches"]}


def reference_rows(preds: list[Prediction], all_records: Sequence[LengthRecord], unit: str = "sample") -> list[dict]:
    """The ceiling (seen), oracle and random rows for one protocol's predictions, in ``unit``:

    - ``ceiling (seen)``: per sample, the mean length of its prompt's samples *that the ranker
      could have seen* under that protocol (held-out prompts: none, so it is random);
    - ``oracle (other samples)``: the mean length of the prompt's other samples anywhere in the
      data, including unseen ones (the data README's ceiling for a prompt-only ranker; NaN where
      no prompt has two samples); per group, ``group_oracle``;
    - ``random``: exact expectation (recall = k/n, Spearman 0);
    - ``task solution (diagnostic)``, only when every text is a synthetic-task prompt: the length
      of the task's correct response, computed by solving the prompt. Not a ranker (it parses
      the task) but the best any model that learns the *task* can do: where it falls short of
      the oracle, the policy's own mistakes set the lengths, and no prompt-only ranker of the
      task can rank them."""
    if unit not in UNITS:
        raise ValueError(f"unknown unit {unit!r}; known: {UNITS}")

    def metrics(scores_of: Callable[[Prediction], np.ndarray]) -> dict[str, float]:
        return batch_metrics(preds, scores_of) if unit == "sample" else group_metrics(preds, scores_of, unit)

    def seen_ceiling(p: Prediction) -> np.ndarray:
        return ceiling_scores([r.key for r in p.records], [r.length for r in p.records],
                              [r.key for r in p.seen], [r.length for r in p.seen])

    rows = [{"ranker": "ceiling (seen)", **metrics(seen_ceiling)}]
    if unit != "sample":
        rows.append(group_oracle(preds, all_records, unit))
    elif len({r.key for r in all_records}) < len(all_records):
        loo = ceiling_scores([r.key for r in all_records], [r.length for r in all_records])
        loo_of = {id(r): s for r, s in zip(all_records, loo)}
        rows.append({"ranker": "oracle (other samples)",
                     **batch_metrics(preds, lambda p: np.array([loo_of[id(r)] for r in p.records]))})
    else:
        rows.append({"ranker": "oracle (other samples)", **{m: float("nan") for m in METRIC_KEYS},
                     "n": rows[0]["n"], "batches": rows[0]["batches"]})
    rand = metrics(lambda p: np.zeros(len(p.records)))
    rand["spearman"] = 0.0 if rand["n"] else float("nan")  # expectation; a constant score's is undefined
    rows.append({"ranker": "random", **rand})
    solution = _synthetic_solution_lengths(all_records)
    if solution is not None:
        rows.append({"ranker": "task solution (diagnostic)",
                     **metrics(lambda p: np.array([solution[r.text] for r in p.records], dtype=np.float64))})
    return [{"unit": unit, **row} for row in rows]


def _synthetic_solution_lengths(records: Sequence[LengthRecord]) -> dict[str, float] | None:
    """text -> length of the synthetic task's correct response, if every text is a synthetic prompt."""
    from streamrl.tasks.synthetic import solve

    out: dict[str, float] = {}
    for r in records:
        if r.text not in out:
            try:
                out[r.text] = float(len(solve(r.text)[0]))
            except ValueError:
                return None
    return out or None


def evaluate(protocol: str, records: Sequence[LengthRecord], rankers: Sequence[str],
             ranker_kwargs: dict[str, dict] | None = None, test_records: Sequence[LengthRecord] | None = None,
             folds: int | None = None, seed: int = 0, warmup_steps: int = 1,
             policy_at: Callable[[int], tuple[str, int] | None] | None = None) -> list[dict]:
    """Rows ``{"protocol", "unit", "ranker", recall@..., "spearman", "n", "batches"}`` for one protocol.

    ``protocol`` is ``prompts``, ``samples``, ``streaming`` (fitted on the first ``warmup_steps``
    steps) or ``transfer`` (then ``records`` is the training set and ``test_records`` the
    evaluation set). First the ``sample`` rows (rankers with ``fit_s``, the wall time of the whole
    protocol, then the reference rows), then the same for each group unit.
    """
    import time

    ranker_kwargs = ranker_kwargs or {}
    rows, ranker_preds = [], []
    for name in rankers:
        def factory(name=name):
            return make_ranker(name, **ranker_kwargs.get(name, {}))
        t0 = time.perf_counter()
        if protocol == "prompts":
            preds = prompt_folds(records, factory, k=folds or 5, seed=seed)
        elif protocol == "samples":
            preds = sample_folds(records, factory, k=folds or 2, seed=seed)
        elif protocol == "streaming":
            preds = streaming(records, factory, warmup_steps=warmup_steps, policy_at=policy_at)
        elif protocol == "transfer":
            if test_records is None:
                raise ValueError("protocol 'transfer' needs test_records")
            preds = transfer(records, test_records, factory)
        else:
            raise ValueError(f"unknown protocol {protocol!r}; known: prompts, samples, streaming, transfer")
        elapsed = time.perf_counter() - t0
        ranker_preds.append((name, preds))
        rows.append({"unit": "sample", "ranker": name, **batch_metrics(preds, lambda p: p.scores), "fit_s": elapsed})
    if not ranker_preds:
        raise ValueError("no rankers given")
    every = list(records) + list(test_records or [])
    layout = ranker_preds[-1][1]  # every ranker's predictions cover the same records and seen sets
    rows.extend(reference_rows(layout, every))
    for unit in UNITS[1:]:
        rows.extend({"unit": unit, "ranker": name, **group_metrics(preds, lambda p: p.scores, unit)}
                    for name, preds in ranker_preds)
        rows.extend(reference_rows(layout, every, unit))
    return [{"protocol": protocol, **row} for row in rows]


def run_suite(data: str, data_dir: Path, rankers: Sequence[str], ranker_kwargs: dict[str, dict] | None = None,
              file: str | Path | None = None, folds: int | None = None, seed: int = 0,
              protocols: Sequence[str] | None = None, step_field: str = "step",
              warmup_steps: int = 1, policy_at: Callable[[int], tuple[str, int] | None] | None = None
              ) -> list[tuple[str, list[dict], str]]:
    """Every protocol that applies to ``data`` (or those of them in ``protocols``): ``(title, rows, note)``.

    ``step_field``, ``warmup_steps`` and ``policy_at`` apply to ``samples`` records: the column that
    orders them, how many of its first steps the streaming protocol fits on before it scores the
    next, and the checkpoint each streaming step is scored under (``checkpoint_resolver``)."""
    def run(protocol: str, recs, test=None) -> list[dict] | None:
        if protocols and protocol not in protocols:
            return None
        from streamrl.metrics import progress

        rows = evaluate(protocol, recs, rankers, ranker_kwargs, test_records=test, folds=folds, seed=seed,
                        warmup_steps=warmup_steps, policy_at=policy_at if data == "samples" else None)
        progress.advance()
        return rows

    out = []
    if data == "qwen-math":
        require_files(data_dir, QWEN_MATH_FILE)
        recs = load_qwen_math(data_dir)
        out.append(("qwen-math: held-out prompts", run("prompts", recs), f"{folds or 5}-fold by prompt"))
        out.append(("qwen-math: held-out samples of seen prompts", run("samples", recs),
                    f"each prompt's 8 responses in {folds or 2} folds"))
        if all((data_dir / n).exists() for n in (SKYTHOUGHT_CSV, MATH500_FILE)):
            test_keys = {r.key for r in recs}
            train = [r for r in load_skythought_math500(data_dir)["Qwen2.5-Math-7B"] if r.key not in test_keys]
            out.append(("train MATH-500 (Qwen2.5-Math-7B) -> test qwen-math", run("transfer", train, recs),
                        f"{len({r.key for r in train})} other prompts, another model"))
    elif data == "skythought":
        require_files(data_dir, SKYTHOUGHT_CSV, AIME_FILE, MATH500_FILE)
        ckpt = load_skythought_checkpoints(data_dir)
        steps = sorted({r.step for r in ckpt})
        out.append((f"skythought AIME24: checkpoints {steps[0]}..{steps[-1]}", run("streaming", ckpt),
                    "fit on the first, score each later one then update; metrics per checkpoint"))
        # One response per prompt and held-out prompts: history has nothing to remember (it is the
        # median, blend is learned), so only the text rankers are trained here.
        text_only = [r for r in rankers if r not in ("history", "blend")] or list(rankers)
        for model, recs in load_skythought_math500(data_dir).items():
            rows = (None if protocols and "prompts" not in protocols
                    else evaluate("prompts", recs, text_only, ranker_kwargs, folds=folds, seed=seed))
            out.append((f"skythought MATH-500 {model}: held-out prompts", rows,
                        f"{folds or 5}-fold by prompt; one response per prompt"))
    elif data == "samples":
        if file is None:
            raise ValueError("data 'samples' needs a records file")
        recs = load_samples_jsonl(file, step_field)
        steps = {r.step for r in recs}
        counts = defaultdict(int)
        for r in recs:
            counts[r.key] += 1
        if len(steps) > warmup_steps:
            out.append((f"{file}: streaming over {len(steps)} steps", run("streaming", recs),
                        f"steps by {step_field!r}: fit on the first {warmup_steps}, score each later one, then "
                        "update with it; metrics per step"))
        if len(counts) >= (folds or 5):
            out.append((f"{file}: held-out prompts", run("prompts", recs), f"{folds or 5}-fold by prompt"))
        if min(counts.values()) >= (folds or 2):
            out.append((f"{file}: held-out samples of seen prompts", run("samples", recs), f"{folds or 2} folds"))
        if not out:
            raise ValueError(f"{file}: one step and too few prompts/samples for any protocol")
    else:
        raise ValueError(f"unknown data {data!r}; known: qwen-math, skythought, samples")
    out = [item for item in out if item[1] is not None]
    if not out:
        raise ValueError(f"none of the protocols {list(protocols or [])} applies to data {data!r}")
    return out

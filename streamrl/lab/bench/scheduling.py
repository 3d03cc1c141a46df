"""`streamrl bench scheduling`: generation makespan of one large batch under each scheduling policy.

One pool of ``instances`` real generation instances (the SGS; one thread each), one batch of
``prompts`` distinct synthetic-task prompts (one response each), and for each configuration of
``CONFIGS`` (dispatch, in-instance order, predictions, rebalancing) the wall time from
submitting the batch to its last sampled token (engine timestamps), against random + FIFO.

Invariants: decoding is greedy, so a recording run's lengths are the oracle for every later run;
the ranker never sees the batch (it is fitted on other prompts, and Algorithm 2's P50/P90 come
from those); every ratio is taken within one batch. ``bench_scheduling`` has the procedure;
results and their reading: docs/results.md.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass

import numpy as np

from streamrl.config import Config


@dataclass(frozen=True)
class SchedConfig:
    name: str
    dispatch: str
    order: str
    predictions: str  # "none" | "ranker" | "oracle"
    rebalance: bool


CONFIGS = (
    SchedConfig("random+fifo", "random", "fifo", "none", False),
    SchedConfig("skew+ranker", "skewness-aware", "lpt", "ranker", False),
    SchedConfig("skew+oracle", "skewness-aware", "lpt", "oracle", False),
    SchedConfig("random+fifo+rebalance", "random", "fifo", "none", True),
    SchedConfig("skew+ranker+rebalance", "skewness-aware", "lpt", "ranker", True),
    SchedConfig("skew+oracle+rebalance", "skewness-aware", "lpt", "oracle", True),
    SchedConfig("search+ranker", "skewness-search", "lpt", "ranker", False),
    SchedConfig("search+oracle", "skewness-search", "lpt", "oracle", False),
    SchedConfig("search+ranker+rebalance", "skewness-search", "lpt", "ranker", True),
    SchedConfig("search+oracle+rebalance", "skewness-search", "lpt", "oracle", True),
    SchedConfig("skew+ranker+hedged", "skewness-aware", "lpt-head", "ranker", False),
    SchedConfig("search+ranker+hedged", "skewness-search", "lpt-head", "ranker", False),
    SchedConfig("skew+ranker+hedged+rebalance", "skewness-aware", "lpt-head", "ranker", True),
)
"""The configurations, each against the baseline::

    random + FIFO                    random dispatch, arrival order (the baseline)
    skew-aware + ranker              Algorithm 2 on the ranker's scores, LPT inside instances
    skew-aware + oracle              Algorithm 2 on the true lengths, LPT
    ... each again + rebalance       ``scheduling.rebalance``, queued and running requests
    search + ranker / oracle         ``skewness-search``: Algorithm 2 with the long-tail fraction
                                     searched and each split simulated (ours; scheduling/dispatch.py)
    ... + ranker + hedged            the same dispatch with ``lpt-head`` inside instances
"""
TARGETS = {"skew+ranker": 0.85, "skew+oracle": 0.75, "search+ranker": 0.85, "search+oracle": 0.75,
           "skew+ranker+hedged": 0.85, "search+ranker+hedged": 0.85}


def lower_bound_s(lengths, latency, instances: int, batch: int, prompt_len: float = 0.0) -> dict[str, float]:
    """The longer of the longest sample alone and all tokens at the engine's peak rate, each with
    the context cost when the profile has one (``kv_ms_per_token``).

    The context term of the all-tokens bound does not depend on the schedule: under the latency
    model a step costs ``kv`` per context token each running request holds, so generating token
    ``g`` of a sample (prompt ``p``) costs ``kv x (p + g)`` wherever and whenever it runs, and a
    sample of ``L`` tokens adds ``kv x (p L + L (L - 1) / 2)``. Shared by the instances."""
    from streamrl.scheduling.dispatch import instance_makespan_s

    sizes = [b for b, _ in latency.points if b <= batch] or [latency.points[0][0]]
    peak = max(latency.tokens_per_s(b) for b in sizes)
    longest = instance_makespan_s([max(lengths)], latency, 1, prompt_len)
    lens = np.asarray(lengths, dtype=np.float64)
    context_s = latency.kv_ms_per_token / 1000.0 * float(np.sum(prompt_len * lens + lens * (lens - 1) / 2))
    all_tokens = (float(lens.sum()) / peak + context_s) / instances
    return {"lower_bound_s": max(longest, all_tokens), "longest_alone_s": longest, "all_tokens_at_peak_s": all_tokens,
            "context_s": context_s / instances, "peak_tokens_per_s_per_instance": peak}


def _measure_latency(cfg: Config, batch: int, prompt_len: int, echo):
    """PTL(BS) of one engine like the instances' (one thread, EOS unreachable), up to ``batch``."""
    import copy

    import torch

    from streamrl.sgs.engines.build import engine_kwargs
    from streamrl.models.tiny import load_policy
    from streamrl.scheduling.latency import LatencyModel
    from streamrl.sgs.engines.base import make_engine
    from streamrl.lab.profiling.decode import context_cost, profile_decode_latency

    sizes = sorted({b for b in (1, 2, 4, 8, 16, 32, 64) if b < batch} | {batch})
    echo(f"scheduling: measuring PTL(BS) at batch sizes {sizes} (1 thread)")
    model, tok = load_policy(cfg.policy.path)
    prev = torch.get_num_threads()
    engine = make_engine(cfg.generation.engine, copy.deepcopy(model).eval(),
                         **{**engine_kwargs(cfg, tok, 1, "profile", cfg.run.seed), "eos_token_id": None})
    try:
        rows = profile_decode_latency(engine, sizes, prompt_len=prompt_len, new_tokens=32, seed=cfg.run.seed)
        kv = context_cost(engine, rows, prompt_len, new_tokens=32, seed=cfg.run.seed)
    finally:
        engine.shutdown()
        torch.set_num_threads(prev)
    echo(f"scheduling: context cost {kv['kv_ms_per_token']:.5f} ms per running context token (batch "
         f"{kv['batch_size']}, +{kv['extra_context']} tokens)")
    return LatencyModel(tuple((r["batch_size"], r["ms_per_token"]) for r in rows), cfg.generation.engine,
                        cfg.policy.path, "cpu", {"kv_ms_per_token": kv["kv_ms_per_token"], "prompt_len": prompt_len})


def _cpu(sgs) -> dict[str, float]:
    import ray

    names = list(sgs.instances)
    return dict(zip(names, ray.get([sgs.instances[n].cpu_seconds.remote() for n in names])))


def _run(sgs, requests, predicted) -> dict:
    cpu0 = _cpu(sgs)
    t0 = time.time()
    done = list(sgs.generate(requests, predicted))
    end = max(c.t_end for c in done)
    cpu = {n: t - cpu0[n] for n, t in _cpu(sgs).items()}
    by_inst: dict[str, float] = {}
    for c in done:
        by_inst[c.instance] = max(by_inst.get(c.instance, 0.0), c.t_end - t0)
    return {"makespan_s": end - t0, "cpu_makespan_s": max(cpu.values()), "instance_cpu_s": cpu,
            "lengths": {c.request_id: len(c.output_ids) for c in done},
            "prompt_lengths": {c.prompt_id: len(c.output_ids) for c in done}, "instance_end_s": by_inst}


def _record_history(cfg: Config, history_policy: str, builder, batch_prompts, instances: int, tok, echo) -> dict[str, int]:
    """Greedy lengths of an earlier checkpoint on the batch prompts (what a ranker remembers from the
    epoch before), from its own instances, which are shut down before the bench's start."""
    from streamrl.models.tiny import load_tokenizer
    from streamrl.sgs.service import StreamGenerationService

    hist_tok = load_tokenizer(history_policy)
    if hist_tok.get_vocab() != tok.get_vocab():
        raise ValueError(f"history_policy={history_policy!r} has another tokenizer than policy.path={cfg.policy.path!r}")
    echo(f"scheduling: history run ({len(batch_prompts)} batch prompts, greedy) with {history_policy}")
    sgs = StreamGenerationService(cfg, policy_path=history_policy, ranker=None, engine_overrides={"temperature": 0.0})
    try:
        sgs.add_instances(instances)
        done = list(sgs.generate(builder.build(batch_prompts, 0, tag="history-")))
    finally:
        sgs.shutdown()
    return {c.prompt_id: len(c.output_ids) for c in done}


def bench_scheduling(cfg: Config, prompts: int = 128, instances: int = 2, batch: int = 16, repeats: int = 8,
                     ranker: str = "learned", ranker_prompts: int | None = 2048, profile: str | None = None,
                     configs=CONFIGS, history_policy: str | None = None, batches: int = 1, echo=print) -> dict:
    """Each configuration's makespan on the same batches, as ratios to random + FIFO.

    Decoding is greedy, so a *recording run*'s lengths are the oracle for every later run (with
    sampling the lengths would depend on which requests share a batch); ``length_match`` reports
    the fraction of requests whose length equalled the recorded one. The ranker is fitted on this
    policy's lengths for ``ranker_prompts`` *other* prompts (``history_policy``: an earlier
    checkpoint's lengths on the batch prompts join them, as a later epoch's history would), and
    Algorithm 2's P50/P90 come from those, never from the batch.

    PTL(BS) and the context cost are measured here first (``profiling.decode``) or read from
    ``profile``. The lower bound (``lower_bound_s``) is the longer of the longest sample alone and
    all tokens at the peak rate, plus every token's context cost; it ignores prefill and
    admission, so it is optimistic. ``max_requests_per_batch`` (``batch``) is below each
    instance's share, so admission order matters. Each configuration runs ``repeats`` times in a
    rotated order (slow drift of the machine favours none); ``batches`` disjoint batches are
    recorded and run in turn and every ratio is the mean over batches of the ratio within a
    batch. Beside wall time, ``cpu_makespan_s`` (the largest instance's CPU seconds during the
    run) is the makespan with one free core per instance, which other processes cannot inflate."""
    from streamrl.controller.common import RequestBuilder
    from streamrl.tasks.factory import make_task
    from streamrl.controller.setup import ensure_policy, init_ray
    from streamrl.models.tiny import load_tokenizer
    from streamrl.scheduling.latency import latency_to_dict, load_profile
    from streamrl.sgs.service import StreamGenerationService

    _check_args(prompts, instances, batch, repeats, batches, configs)
    ranker_prompts = ranker_prompts or prompts
    cfg = cfg.model_copy(deep=True)
    g = cfg.generation
    g.num_instances, g.threads_per_instance, g.max_requests_per_batch, g.n_samples = instances, 1, batch, 1
    ensure_policy(cfg, echo)
    task = make_task(cfg)
    pool = list(task.train_prompts())
    batch_sets, other_prompts = _split_pool(pool, cfg.run.seed, prompts, batches, ranker_prompts)
    all_batch_prompts = [p for ps in batch_sets for p in ps]
    tok = load_tokenizer(cfg.policy.path)
    builder = RequestBuilder(tok, cfg)
    prompt_len = float(np.mean([len(r.prompt_ids) for r in builder.build(batch_sets[0][:64], 0)]))
    latency = load_profile(profile) if profile else _measure_latency(cfg, batch, round(prompt_len), echo)

    init_ray(cfg)
    hist_len = (_record_history(cfg, history_policy, builder, all_batch_prompts, instances, tok, echo)
                if history_policy else {})
    sgs = StreamGenerationService(cfg, ranker=None, engine_overrides={"temperature": 0.0}, hold_back=True)
    sgs.latency = latency  # rebalancing's model: the PTL measured (or read) above
    per_batch, batch_lengths, ranker_scores = [], {}, {}
    try:
        sgs.add_instances(instances)
        list(sgs.generate(builder.build(other_prompts[: 2 * batch * instances], 0, tag="warmup-")))
        echo(f"scheduling: ranker data ({ranker_prompts} other prompts, greedy), then {batches} batch(es) of "
             f"{prompts} prompts")
        rk, fit_info, other_len = _fit_ranker(sgs, builder, ranker, cfg.policy.path, pool, other_prompts, hist_len)
        from streamrl.metrics import progress

        progress.total(len(batch_sets))
        for b, batch_prompts in enumerate(batch_sets):
            table, lengths, scores = _bench_batch(sgs, builder, batch_prompts, rk, fit_info, hist_len, history_policy,
                                                  list(other_len.values()), latency, configs, repeats, instances,
                                                  batch, prompt_len, cfg, b, echo)
            per_batch.append(table)
            progress.advance()
            batch_lengths.update(lengths)
            ranker_scores.update(scores)
    finally:
        sgs.shutdown()
    result = _aggregate(configs, per_batch, latency_to_dict(latency), dict(
        prompts=prompts, batches=batches, instances=instances, batch=batch, repeats=repeats,
        max_new_tokens=g.max_new_tokens, policy=cfg.policy.path, rebalance_threshold=g.rebalance_threshold,
        skew_alpha=g.skew_alpha, decoding="greedy"))
    # The greedy lengths themselves (batches and ranker data), so the table can be re-modelled offline.
    result["recorded_lengths"] = {"batch": batch_lengths, "ranker_data": other_len, "history": hist_len}
    result["ranker_scores"] = ranker_scores
    return result


def _check_args(prompts: int, instances: int, batch: int, repeats: int, batches: int, configs) -> None:
    """``bench_scheduling``'s arguments: a ValueError for any it cannot run with."""
    if instances < 2:
        raise ValueError(f"instances={instances}: the scheduling bench needs >= 2 generation instances")
    if prompts < 2 * instances:
        raise ValueError(f"prompts={prompts}: need at least 2 per instance ({2 * instances})")
    if batch < 1 or repeats < 1 or batches < 1:
        raise ValueError(f"batch={batch}, repeats={repeats} and batches={batches} must be >= 1")
    unknown = [c for c in configs if c not in CONFIGS]
    if unknown:
        raise ValueError(f"unknown configurations {unknown}; known: {[c.name for c in CONFIGS]}")


def _split_pool(pool: list, seed: int, prompts: int, batches: int, ranker_prompts: int) -> tuple[list[list], list]:
    """Shuffles the task's training prompts (``pool``, in place) with ``seed``; returns ``batches``
    disjoint batches of ``prompts`` prompts and the ``ranker_prompts`` other prompts after them."""
    if len(pool) < batches * prompts + ranker_prompts:
        raise ValueError(f"the task has {len(pool)} training prompts; need batches x prompts + ranker_prompts = "
                         f"{batches * prompts + ranker_prompts} (raise task.num_train)")
    random.Random(seed).shuffle(pool)
    batch_sets = [pool[b * prompts:(b + 1) * prompts] for b in range(batches)]
    return batch_sets, pool[batches * prompts:batches * prompts + ranker_prompts]


def _fit_ranker(sgs, builder, ranker: str, policy_path: str, pool, other_prompts, hist_len: dict[str, int]):
    """Records this policy's greedy lengths on ``other_prompts`` (round-robin, FIFO) and fits the
    ranker on them and on ``hist_len`` (an earlier checkpoint's lengths on the batch prompts);
    returns the ranker, its fit info and the recorded lengths by prompt key."""
    from streamrl.ranker.base import make_ranker

    sgs.configure("round-robin", "fifo", False)
    other = _run(sgs, builder.build(other_prompts, 0, tag="rankdata-"), None)
    other_len = other["prompt_lengths"]
    text_of = {p.prompt_id: p.text for p in pool}
    fit_len = {**other_len, **hist_len}  # the batch prompts' keys are disjoint from the others'
    t_fit = time.perf_counter()
    rk = make_ranker(ranker, policy_path=policy_path).fit([text_of[k] for k in fit_len], list(fit_len.values()), list(fit_len))
    fit_s = time.perf_counter() - t_fit
    fit_info = {"ranker": ranker, "fit_s": fit_s, "train_prompts": len(other_len), "fit_prompts": len(fit_len)}
    return rk, fit_info, other_len


def _bench_batch(sgs, builder, batch_prompts, rk, fit_info, hist_len, history_policy, history, latency, configs,
                 repeats, instances, batch, prompt_len, cfg, index, echo) -> tuple[dict, dict, dict]:
    """One batch: its recording run (the oracle lengths), the ranker's scores, and every configuration
    ``repeats`` times in rotated order; returns ``_summarise``'s dict for the batch, and the batch's
    recorded lengths and ranker scores by prompt key."""
    from streamrl.ranker.metrics import rank_metrics

    g = cfg.generation
    sgs.configure("round-robin", "fifo", False)
    rec = _run(sgs, builder.build(batch_prompts, 0, tag=f"record{index}-"), None)
    oracle = rec["prompt_lengths"]
    t_score = time.perf_counter()
    scores = dict(zip([p.prompt_id for p in batch_prompts],
                      rk.score([p.text for p in batch_prompts], [p.prompt_id for p in batch_prompts]).tolist()))
    score_s = time.perf_counter() - t_score
    true = [oracle[p.prompt_id] for p in batch_prompts]
    ranker_row = {**fit_info, **rank_metrics(true, [scores[p.prompt_id] for p in batch_prompts]), "score_s": score_s}
    if hist_len:  # how well the earlier checkpoint's lengths alone rank this policy's
        ranker_row["history_policy"] = history_policy
        ranker_row["history_alone"] = rank_metrics(true, [hist_len[p.prompt_id] for p in batch_prompts])
    bound = lower_bound_s(true, latency, instances, batch, prompt_len)
    runs: dict[str, list[dict]] = {c.name: [] for c in configs}
    for rep in range(repeats):
        shift = rep % len(configs)
        for c in list(configs[shift:]) + list(configs[:shift]):
            kwargs = {"seed": cfg.run.seed + 1000 * index + rep} if c.dispatch == "random" else {
                "latency": latency, "max_batch_size": batch, "history": history}
            if c.dispatch == "skewness-aware":
                kwargs["alpha"] = g.skew_alpha
            if c.dispatch == "skewness-search":
                kwargs["prompt_len"] = prompt_len
            sgs.configure(c.dispatch, c.order, c.rebalance, kwargs)
            reqs = builder.build(batch_prompts, 0, tag=f"{c.name}-{index}-{rep}-")
            pred = None if c.predictions == "none" else [
                float((scores if c.predictions == "ranker" else oracle)[r.prompt_id]) for r in reqs]
            moved0, running0 = sgs.counters["sgs/rebalanced"], sgs.counters["sgs/rebalanced_running"]
            load = os.getloadavg()[0]
            res = _run(sgs, reqs, pred)
            res["loadavg_1m_before"] = load
            res["moved"] = sgs.counters["sgs/rebalanced"] - moved0
            res["moved_running"] = sgs.counters["sgs/rebalanced_running"] - running0
            res["length_match"] = float(np.mean([res["lengths"][r.request_id] == oracle[r.prompt_id] for r in reqs]))
            res["tokens"] = sum(res["lengths"].values())
            del res["lengths"]
            runs[c.name].append(res)
            echo(f"  batch {index} {c.name:24s} rep {rep}: makespan {res['makespan_s']:.2f}s, moved {res['moved']} "
                 f"({res['moved_running']} running), length match {res['length_match']:.3f}")
    out = _summarise(configs, runs, bound, ranker_row, rec, dict(
        total_tokens=int(sum(true)), mean_len=float(np.mean(true)), p50_len=float(np.percentile(true, 50)),
        p90_len=float(np.percentile(true, 90)), max_len=int(max(true))))
    out["batch"] = index
    return out, {p.prompt_id: oracle[p.prompt_id] for p in batch_prompts}, scores


def _summarise(configs, runs, bound, ranker_row, rec, stats) -> dict:
    """One batch's table: each configuration's mean makespan over its runs, normalised to random+FIFO."""
    rows = []
    base = np.mean([r["makespan_s"] for r in runs["random+fifo"]]) if runs.get("random+fifo") else float("nan")
    base_cpu = np.mean([r["cpu_makespan_s"] for r in runs["random+fifo"]]) if runs.get("random+fifo") else float("nan")
    for c in configs:
        ms = [r["makespan_s"] for r in runs[c.name]]
        mean = float(np.mean(ms))
        cpu = float(np.mean([r["cpu_makespan_s"] for r in runs[c.name]]))
        rows.append({"config": c.name, "dispatch": c.dispatch, "order": c.order, "predictions": c.predictions,
                     "rebalance": c.rebalance, "makespan_s": mean, "makespan_min_s": float(min(ms)),
                     "makespan_max_s": float(max(ms)), "makespan_median_s": float(np.median(ms)),
                     "vs_random_fifo": mean / base, "cpu_makespan_s": cpu, "cpu_vs_random_fifo": cpu / base_cpu,
                     "vs_lower_bound": mean / bound["lower_bound_s"],
                     "moved": float(np.mean([r["moved"] for r in runs[c.name]])),
                     "moved_running": float(np.mean([r["moved_running"] for r in runs[c.name]])),
                     "length_match": float(np.mean([r["length_match"] for r in runs[c.name]])),
                     "runs": runs[c.name]})
    stats["loadavg_1m_mean"] = float(np.mean([r["loadavg_1m_before"] for rs in runs.values() for r in rs]))
    return {"stats": stats, "rows": rows, "lower_bound": bound, "ranker": ranker_row,
            "recording_run_s": rec["makespan_s"]}


def _checks(configs, per_batch) -> list[dict]:
    """The issue's targets, each the mean over batches of that batch's ratio (a batch's ratios share its
    prompts, so they are compared within a batch and only then averaged)."""
    names = {c.name for c in configs}
    by = [{r["config"]: r for r in pb["rows"]} for pb in per_batch]

    def ratio(name: str, ref: str, key: str) -> tuple[float, list[float]]:
        vals = [b[name][key] / b[ref][key] for b in by]
        return float(np.mean(vals)), vals

    checks = []
    for metric, key in (("wall", "makespan_s"), ("cpu", "cpu_makespan_s")):
        pairs = [(name, "random+fifo", f"{name} <= {target} x random+fifo ({metric})", target)
                 for name, target in TARGETS.items() if name in names and "random+fifo" in names]
        pairs += [(c.name, c.name.replace("+rebalance", ""), f"{c.name} <= {c.name.replace('+rebalance', '')} ({metric})", 1.0)
                  for c in configs if c.rebalance and c.name.replace("+rebalance", "") in names]
        for name, ref, label, target in pairs:
            v, vals = ratio(name, ref, key)
            checks.append({"check": label, "value": v, "met": bool(v <= target), "by_batch": vals})
    return checks


def _aggregate(configs, per_batch, latency, setup) -> dict:
    """The table over all batches: per configuration, the mean over batches of each batch's numbers
    (ratios are formed within a batch first); ``per_batch`` keeps every batch's own table."""
    def mean_of(key: str, rows: list[dict]) -> float:
        return float(np.mean([r[key] for r in rows]))

    rows = []
    for c in configs:
        rs = [next(r for r in pb["rows"] if r["config"] == c.name) for pb in per_batch]
        row = {k: rs[0][k] for k in ("config", "dispatch", "order", "predictions", "rebalance")}
        for key in ("makespan_s", "makespan_median_s", "vs_random_fifo", "cpu_makespan_s", "cpu_vs_random_fifo",
                    "vs_lower_bound", "moved", "moved_running", "length_match"):
            row[key] = mean_of(key, rs)
        row["makespan_min_s"] = min(r["makespan_min_s"] for r in rs)
        row["makespan_max_s"] = max(r["makespan_max_s"] for r in rs)
        row["vs_random_fifo_by_batch"] = [r["vs_random_fifo"] for r in rs]
        rows.append(row)
    stats = [pb["stats"] for pb in per_batch]
    for key in ("total_tokens", "mean_len", "p50_len", "p90_len", "max_len", "loadavg_1m_mean"):
        setup[key] = float(np.mean([st[key] for st in stats])) if len(stats) > 1 else stats[0][key]
    metric_keys = [k for k in per_batch[0]["ranker"] if k.startswith("recall@") or k == "spearman" or k == "score_s"]
    ranker = {**{k: v for k, v in per_batch[0]["ranker"].items() if k not in metric_keys and k != "history_alone"},
              **{k: mean_of(k, [pb["ranker"] for pb in per_batch]) for k in metric_keys}}
    if "history_alone" in per_batch[0]["ranker"]:
        alone = [pb["ranker"]["history_alone"] for pb in per_batch]
        ranker["history_alone"] = {k: mean_of(k, alone) for k in alone[0]}
    bounds = [pb["lower_bound"] for pb in per_batch]
    return {"setup": setup, "rows": rows, "checks": _checks(configs, per_batch), "ranker": ranker,
            "lower_bound": {k: mean_of(k, bounds) for k in bounds[0]}, "latency_profile": latency,
            "recording_run_s": mean_of("recording_run_s", per_batch), "per_batch": per_batch}

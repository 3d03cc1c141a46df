"""`streamrl bench modes`: all four modes on the same workload, seeds and resources.

For each mode (``run_mode``): a fresh pipeline, ``warmup`` untimed iterations, then
``iterations`` timed ones; throughput is samples (and response tokens) over the timed wall time,
busy fractions come from the stage timeline over the same window. ``bench_modes`` adds each
mode's pipeline efficiency and speed-up over colocated; a row name may carry a ``+variant``
that switches scheduling policies on (``mode_config``, ``VARIANTS``).

Invariant: the disaggregated modes all use the same resources (trainer: ``trainer.threads``
CPUs; SGS: ``num_instances x threads_per_instance``); colocated gives both stages all
``cluster.num_cpus`` CPUs and the same continuous-batching engine (no static batch waiting for
its longest member). Results: docs/results.md.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np

from streamrl.config import Config

from streamrl.modes import MODE_NAMES as MODES
VARIANTS: dict[str, dict[str, str]] = {
    "skew": {"dispatch": "skewness-aware", "order": "lpt"},
    "skew-rebalance": {"dispatch": "skewness-aware", "order": "lpt", "rebalance": True},
}
RANK_KEYS = ("rank/recall@20%", "rank/recall@10%", "rank/recall@5%", "rank/spearman")


ASYNC_ROW = re.compile(r"stream-async(?:-k(\d+))?(-partial)?")
"""``stream-async-k<k>`` (``trainer.max_staleness=k``) and ``...-partial``
(``generation.partial_rollout``): rows beyond one-step asynchrony."""


def mode_config(cfg: Config, mode: str) -> Config:
    """``cfg`` for one bench row: ``MODE`` or ``MODE+VARIANT``; MODE may also be
    ``stream-async-k<k>[-partial]`` or ``stream-async-partial`` (``ASYNC_ROW``).

    A variant switches scheduling policies on for that row, e.g. ``stream-async+skew`` =
    stream-async with skewness-aware dispatch (Algorithm 2), LPT order inside instances and the
    configured ranker (``ranker`` section; scored ahead, refreshed in the background each
    iteration). Its rows also carry the ranker's per-batch recall/Spearman, averaged over the
    timed iterations."""
    base, _, variant = mode.partition("+")
    staleness, partial = None, False
    m = ASYNC_ROW.fullmatch(base)
    if m and base != "stream-async":
        staleness, partial, base = int(m.group(1)) if m.group(1) else None, bool(m.group(2)), "stream-async"
        if staleness is not None and staleness < 1:
            raise ValueError(f"{mode!r}: the staleness bound k must be >= 1")
    if base not in MODES:
        raise ValueError(f"unknown mode {base!r} in {mode!r}; known: {list(MODES)} and "
                         "stream-async-k<k>[-partial], stream-async-partial")
    if variant and variant not in VARIANTS:
        raise ValueError(f"unknown scheduling variant {variant!r} in {mode!r}; known: {sorted(VARIANTS)}")
    if variant and base == "colocated":
        raise ValueError(f"{mode!r}: colocated mode has no SGS to dispatch over")
    out = cfg.model_copy(deep=True)
    out.mode = base
    if staleness is not None:
        out.trainer.max_staleness = staleness
    if partial:
        out.generation.partial_rollout = True
    for key, value in VARIANTS.get(variant, {}).items():
        setattr(out.generation, key, value)
    return out


def run_mode(cfg: Config, warmup: int, iterations: int, out_dir: Path, name: str | None = None) -> dict:
    """One bench row: a fresh pipeline, ``warmup`` iterations (not timed: actor start, first
    weight install, and for stream-async the first iteration that has nothing to overlap with),
    then ``iterations`` timed iterations. Throughput is samples (and response tokens) over the
    timed wall time; busy fractions come from the stage timeline over the same window."""
    from streamrl.controller.common import PromptStream
    from streamrl.tasks.factory import make_task
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.metrics.timeline import gantt
    from streamrl.models.tiny import load_tokenizer

    task = make_task(cfg)
    tok = load_tokenizer(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=cfg.run.seed)
    per_iter, t_start = [], None
    samples_n = tokens_n = 0
    lengths: list[int] = []
    try:
        for it in range(warmup + iterations):
            if it == warmup:
                pipe.finish()
                t_start = time.time()
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            upcoming = stream.upcoming(cfg.generation.prompts_per_iter, min(pipe.lookahead, warmup + iterations - it - 1))
            if it == warmup - 1 and cfg.generation.partial_rollout:
                upcoming = None  # nothing admitted ahead across the window's start: no timed work done untimed
            samples, metrics = pipe.step(it, prompts, upcoming)
            if it >= warmup:
                samples_n += len(samples)
                tokens_n += sum(s.num_response_tokens for s in samples)
                lengths.extend(s.num_response_tokens for s in samples)
                per_iter.append(metrics)
        pipe.finish()
        wall = time.time() - t_start
        timeline = pipe.timeline
    finally:
        pipe.shutdown()
        ctx.reward_runner.close()
    summary = timeline.summary(t0=t_start, t1=t_start + wall)
    rows = timeline.rows()
    gen_rows = [r for r in rows if r != "trainer"]
    if cfg.mode == "colocated":
        gen_busy = summary.get("busy/colocated-0/generate", 0.0)
        train_busy = summary.get("busy/colocated-0/train", 0.0)
    else:
        gen_busy = float(np.mean([summary.get(f"busy/{r}/generate", 0.0) for r in gen_rows])) if gen_rows else 0.0
        train_busy = summary.get("busy/trainer", 0.0)
    name = name or cfg.mode
    out_dir.mkdir(parents=True, exist_ok=True)
    png = out_dir / f"gantt_{name}.png"
    timeline.to_json(out_dir / f"timeline_{name}.json")
    gantt(timeline, png, title=f"{name} ({cfg.trainer.algo}, {iterations} timed iterations)")
    mean = lambda k: float(np.nanmean([m[k] for m in per_iter if k in m])) if any(k in m for m in per_iter) else float("nan")  # noqa: E731
    ranking = {k: mean(k) for k in RANK_KEYS if any(k in m for m in per_iter)}
    return {"mode": name, **ranking, "samples_per_s": samples_n / wall, "tokens_per_s": tokens_n / wall,
            "step_s": wall / iterations, "gen_busy": gen_busy, "train_busy": train_busy,
            "gen_s": mean("time/gen_s"),
            # the trainer's whole stage: optimizer steps plus per-sample work (ref/critic forwards)
            "train_s": mean("time/train_s") + (mean("time/prepare_s") if cfg.mode != "colocated" else 0.0),
            "reward_mean": mean("reward/mean"), "gantt": str(png),
            "staleness_max": max((m.get("staleness/max", 0) for m in per_iter), default=0),
            "staleness_token_mean": mean("staleness/token_mean"),
            "response_lengths": lengths}


def thread_scaling(cfg: Config) -> list[dict]:
    """Generation and training tokens/s of this policy at 1 and 2 threads, measured here."""
    import copy

    import torch

    from streamrl.sgs.engines.build import engine_kwargs, run_to_completion
    from streamrl.controller.common import RequestBuilder, group_samples
    from streamrl.tasks.factory import make_task
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.engines.base import make_engine
    from streamrl.trainer.trainer import Trainer
    from streamrl.types import Sample

    task = make_task(cfg)
    model, tok = load_policy(cfg.policy.path)
    prompts = task.train_prompts()[: cfg.generation.prompts_per_iter]
    requests = RequestBuilder(tok, cfg).build(prompts, 0, tag="threads-")
    rows = []
    completions = None
    for threads in (1, 2):
        engine = make_engine(cfg.generation.engine, copy.deepcopy(model).eval(),
                             **engine_kwargs(cfg, tok, threads, "bench", cfg.run.seed))
        t0 = time.time()
        completions = run_to_completion(engine, [r for r in requests])
        gen_s = time.time() - t0
        engine.shutdown()
        tcfg = cfg.model_copy(deep=True)
        tcfg.trainer.threads = threads
        tr = Trainer(tcfg)
        by_id = {p.prompt_id: p for p in prompts}
        samples = [Sample(prompt=by_id[c.prompt_id], sample_idx=c.sample_idx, completion=c,
                          response_text="", reward=float(i % 2)) for i, c in enumerate(completions)]
        tr.begin_iteration()
        groups = tr.prepare_groups(group_samples(samples))
        if cfg.trainer.algo == "grpo":
            tr.set_group_advantages(groups)
        t0 = time.time()
        tr.train_iteration(groups)
        train_s = time.time() - t0
        torch.set_num_threads(1)
        gen_tokens = sum(len(c.output_ids) for c in completions)
        train_tokens = sum(len(c.prompt_ids) + len(c.output_ids) for c in completions)
        rows.append({"threads": threads, "gen_tokens_per_s": gen_tokens / gen_s, "train_tokens_per_s": train_tokens / train_s})
    return rows


def bench_modes(cfg: Config, warmup: int, iterations: int, out_dir: Path, modes=MODES, echo=print,
                colocated_threads: tuple[int, ...] | None = None) -> dict:
    """Every mode in ``modes``; colocated once per thread count in ``colocated_threads``
    (default: 1 and ``cluster.num_cpus``) and its fastest run is the row the others are compared
    with: in one process the engine's loop thread and the trainer each keep an OpenMP team, and
    on a 2-core machine 1 thread has measured faster than 2 (docs/results.md), so a fixed
    thread count would not be the fair baseline. ``colocated_by_threads`` keeps every run.

    Pipeline efficiency (per mode) = the step time of a perfect overlap / the measured step
    time, where the perfect overlap is ``max(generation alone, training alone)`` on the
    disaggregated resources (training = optimizer steps + per-sample reference/critic work),
    each *measured* in disagg-batch mode (there the stages never overlap, so its generation and
    training times are the stages alone)."""
    from streamrl.controller.setup import ensure_policy, init_ray

    cfgs = {mode: mode_config(cfg, mode) for mode in modes}  # bad names fail before anything runs
    threads_list = sorted(set(colocated_threads or (1, cfg.cluster.num_cpus)))
    bad = [t for t in threads_list if not 1 <= t <= cfg.cluster.num_cpus]
    if bad:
        raise ValueError(f"colocated_threads {bad}: each must be in [1, cluster.num_cpus={cfg.cluster.num_cpus}]")
    ensure_policy(cfg, echo)
    scaling = thread_scaling(cfg)
    init_ray(cfg)
    from streamrl.metrics import progress

    progress.total(len(modes) - ("colocated" in modes) + ("colocated" in modes) * len(threads_list))
    rows, colocated_by_threads = [], {}
    for mode in modes:
        if mode == "colocated":
            runs = []
            for t in threads_list:
                c = cfgs[mode].model_copy(deep=True)
                c.cluster.num_cpus = t
                echo(f"bench: colocated at {t} thread(s) ({warmup} warm-up + {iterations} timed iterations)")
                runs.append(run_mode(c, warmup, iterations, out_dir, name=f"colocated-{t}t"))
                runs[-1]["threads"] = t
                progress.advance()
                colocated_by_threads[t] = runs[-1]["samples_per_s"]
                echo(f"  {runs[-1]['samples_per_s']:.2f} samples/s, step {runs[-1]['step_s']:.2f}s")
            best = max(runs, key=lambda r: r["samples_per_s"])
            best["mode"] = "colocated"
            rows.append(best)
            continue
        echo(f"bench: {mode} ({warmup} warm-up + {iterations} timed iterations)")
        rows.append(run_mode(cfgs[mode], warmup, iterations, out_dir, name=mode))
        progress.advance()
        echo(f"  {rows[-1]['samples_per_s']:.2f} samples/s, step {rows[-1]['step_s']:.2f}s")
    by_mode = {r["mode"]: r for r in rows}
    base = by_mode.get("disagg-batch")
    perfect = max(base["gen_s"], base["train_s"]) if base else float("nan")
    for r in rows:
        r["pipeline_efficiency"] = perfect / r["step_s"]
        r["speedup_vs_colocated"] = r["samples_per_s"] / by_mode["colocated"]["samples_per_s"] if "colocated" in by_mode else float("nan")
    train_share = base["train_s"] / (base["gen_s"] + base["train_s"]) if base else float("nan")
    return {"rows": rows, "thread_scaling": scaling, "train_share_of_step": train_share,
            "perfect_overlap_step_s": perfect, "warmup": warmup, "iterations": iterations,
            "colocated_by_threads": colocated_by_threads}

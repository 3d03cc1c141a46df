"""The measuring primitives of ``streamrl profile``: decode rows per batch size, the colocated
switch, generated samples, and the trainer's per-sample, per-call and per-step times.

``live`` (the whole profile) and ``overlap`` (each stage timed beside the other) both build on these.
"""

from __future__ import annotations

import copy
import time
from typing import Any, Sequence

import numpy as np

from streamrl.config import Config
from streamrl.lab.profiling.decode import context_cost

REPEATS = 3
"""Each timed piece (a PTL point, a one-token run, a prepare call, an optimizer step) is measured
this many times and the median kept. Medians, not minima: the bench reports means over
iterations, and on a quiet machine two profiles taken 30 minutes apart with minima differed by
27% in optimizer-step rate (1731 vs 2204 tokens/s) while each was 11-13% off the bench's own.
Neither statistic rescues a loaded machine: a 2-thread OpenMP team is slowed far more than one
thread by a competing process (measured: under a load of ~10 on the 2 cores, 128 per-sample
prepares took 6.1 s at 1 thread and 51.9 s at 2 threads while the fastest single call was 8.8 vs
9.6 ms)."""


def decode_engine(cfg: Config, model, tokenizer, threads: int, seed: int):
    """The configured engine at ``threads`` threads, built like the live SGS and colocated worker
    build it (``controller.colocated.engine_kwargs``) except that EOS is unreachable."""
    from streamrl.sgs.engines.build import engine_kwargs
    from streamrl.sgs.engines.base import make_engine

    kw = {**engine_kwargs(cfg, tokenizer, threads, "profile", seed), "eos_token_id": None}
    return make_engine(cfg.generation.engine, copy.deepcopy(model).eval(), **kw)


def decode_rows(engine, vocab: int, batch_sizes: Sequence[int], prompt_len: int, new_tokens: int, seed: int,
                repeats: int = REPEATS) -> tuple[list[dict[str, float]], list[dict[str, float]]]:
    """PTL(BS) rows of ``engine`` (median of ``repeats``) and its one-token rows: wall seconds to
    admit ``batch_size`` requests, prefill their prompts and return one token each
    (``fit_prefill`` turns them into a prefill cost)."""
    from streamrl.lab.profiling.decode import engine_run, random_prompts, profile_decode_latency

    runs: dict[int, list[dict[str, float]]] = {}
    one: dict[int, list[float]] = {}
    for _ in range(max(1, repeats)):
        for r in profile_decode_latency(engine, list(batch_sizes), prompt_len=prompt_len, new_tokens=new_tokens, seed=seed):
            runs.setdefault(int(r["batch_size"]), []).append(r)
        for b in batch_sizes:
            one.setdefault(b, []).append(engine_run(engine, random_prompts(b, prompt_len, vocab, seed + 1), 1)[0])
    rows = []
    for b in sorted(runs):
        ms = float(np.median([r["ms_per_token"] for r in runs[b]]))
        rows.append({"batch_size": b, "ms_per_token": ms, "tokens_per_s": b / (ms / 1000.0) if ms > 0 else float("inf")})
    return rows, [{"batch_size": b, "one_token_s": float(np.median(one[b])), "prompt_len": prompt_len} for b in sorted(one)]


def measure_decode(cfg: Config, model, tokenizer, threads: int, batch_sizes: Sequence[int], prompt_len: int,
                   new_tokens: int, seed: int, repeats: int = REPEATS) -> tuple[list[dict], list[dict], dict]:
    """``decode_rows`` and ``context_cost`` of a fresh engine at ``threads`` threads (shut down afterwards)."""
    engine = decode_engine(cfg, model, tokenizer, threads, seed)
    try:
        points, one = decode_rows(engine, int(model.config.get_text_config().vocab_size), batch_sizes, prompt_len,
                                  new_tokens, seed, repeats)
        return points, one, context_cost(engine, points, prompt_len, new_tokens, seed, repeats)
    finally:
        engine.shutdown()


def measure_colocated(cfg: Config, model, tokenizer, samples: list, threads: int, batch_sizes: Sequence[int],
                      prompt_len: int, new_tokens: int, train_steps: int, repeats: int = REPEATS) -> dict[str, Any]:
    """Generation and training costs at ``threads`` threads in the colocated worker's process
    layout: an engine and a trainer alive in one process, each with its own OpenMP team.

    The layout matters on a small CPU: libgomp spins ~300k iterations at a barrier before sleeping,
    but only 100 when it manages more threads than there are CPUs, which is the case as soon as
    the engine's loop thread and the trainer's thread each hold a team of ``threads``. The workers
    then sleep on a futex after every parallel region and each region pays a wake-up. Measured on
    the tiny policy, 2 threads, 2 CPUs, quiet machine: the colocated PPO train body took 2.3-2.4 s
    with ~25 voluntary context switches and no engine, 3.7-3.8 s with ~19,900 with an idle engine
    alive (the same 3.5-3.6 s as ``OMP_WAIT_POLICY=PASSIVE`` without one), 2.2 s again after the
    engine's shutdown; at 1 thread 2.6-2.8 s either way. So the trainer is measured here while an
    engine that has generated is alive, and the decode latency after the trainer's team exists.
    """
    from streamrl.lab.profiling.decode import engine_run, random_prompts

    vocab = int(model.config.get_text_config().vocab_size)
    engine = decode_engine(cfg, model, tokenizer, threads, cfg.run.seed)
    try:
        engine_run(engine, random_prompts(8, prompt_len, vocab, cfg.run.seed), 4)  # its loop thread's team exists now
        train = measure_train(cfg, samples, threads, train_steps, repeats)
        points, one = decode_rows(engine, vocab, batch_sizes, prompt_len, new_tokens, cfg.run.seed, repeats)
        kv = context_cost(engine, points, prompt_len, new_tokens, cfg.run.seed, repeats)
    finally:
        engine.shutdown()
    return {"threads": threads, "layout": "engine and trainer in one process (as controller.colocated.ColocatedWorker)",
            "points": [{"batch_size": r["batch_size"], "ms_per_token": r["ms_per_token"]} for r in points],
            "train_tokens_per_s": train["train_tokens_per_s"], "train": train, "rows": points,
            "kv_ms_per_token": kv["kv_ms_per_token"], "kv": kv,
            "prefill": {**fit_prefill(one, points), "rows": one}}


def fit_prefill(one_rows: Sequence[dict], ptl_rows: Sequence[dict]) -> dict[str, float]:
    """Per-request admission + prefill cost from the one-token runs: ``one_token_s(b) - PTL(b)``
    (the run's own decode step) is fitted as ``c + d * b`` over the batch sizes; ``d`` is the
    cost of one more request (its prompt's prefill and its admission), reported also as a rate per
    prompt token (the simulator's ``prefill_s(tokens)`` charges per admitted request's tokens)."""
    ptl = {int(r["batch_size"]): r["ms_per_token"] / 1000.0 for r in ptl_rows}
    xs = [int(r["batch_size"]) for r in one_rows if int(r["batch_size"]) in ptl]
    ys = [float(r["one_token_s"]) - ptl[int(r["batch_size"])] for r in one_rows if int(r["batch_size"]) in ptl]
    c, d = fit_per_sample(ys, xs)
    p_len = float(one_rows[0]["prompt_len"]) if one_rows else 0.0
    return {"s_per_request": d, "fixed_s": c, "prompt_len": p_len,
            "tokens_per_s": p_len / d if d > 0 and p_len > 0 else float("inf")}


def generate_samples(cfg: Config, model, tokenizer, task, threads: int) -> tuple[list, float]:
    """One iteration of the real workload, generated and scored: ``(samples, generation seconds)``."""
    from streamrl.sgs.engines.build import engine_kwargs, run_to_completion
    from streamrl.controller.common import RequestBuilder
    from streamrl.sgs.engines.base import make_engine
    from streamrl.types import Sample

    prompts = task.train_prompts()[: cfg.generation.prompts_per_iter]
    by_id = {p.prompt_id: p for p in prompts}
    requests = RequestBuilder(tokenizer, cfg).build(prompts, 0, tag="profile-")
    engine = make_engine(cfg.generation.engine, copy.deepcopy(model).eval(),
                         **engine_kwargs(cfg, tokenizer, threads, "profile", cfg.run.seed))
    try:
        t0 = time.perf_counter()
        completions = run_to_completion(engine, requests)
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    samples = []
    for c in completions:
        prompt = by_id[c.prompt_id]
        text = tokenizer.decode(list(c.output_ids), skip_special_tokens=True)
        samples.append(Sample(prompt=prompt, sample_idx=c.sample_idx, completion=c, response_text=text,
                              reward=float(task.reward(prompt, text))))
    return samples, gen_s


def _sample_group_tokens(group: list) -> int:
    return sum(len(s.completion.prompt_ids) + len(s.completion.output_ids) for s in group)


def voluntary_switches() -> int:
    """Voluntary context switches of this process so far, all threads (Linux; 0 elsewhere). An
    OpenMP team whose workers sleep between parallel regions shows up here (one per region)."""
    import glob

    n = 0
    for f in glob.glob("/proc/self/task/*/status"):
        try:
            with open(f) as fh:
                n += sum(int(line.split()[1]) for line in fh if line.startswith("voluntary_ctxt_switches"))
        except (FileNotFoundError, ProcessLookupError):
            pass
    return n


def live_units(samples: list, algo: str) -> list[list]:
    """The trainer's per-sample work units, as the live pipelines cut them
    (``controller/common.py``, ``units_of``): a prompt's group for GRPO
    (advantages need the whole group), one sample for PPO. A trainer call carries whole units."""
    from streamrl.controller.common import group_samples

    return group_samples(samples) if algo == "grpo" else [[s] for s in samples]


def fit_per_sample(seconds: Sequence[float], tokens: Sequence[int]) -> tuple[float, float]:
    """Least-squares ``seconds = a + b * tokens`` over per-unit timings: ``(a, b)``, both >= 0
    (a negative fitted term is noise: it is set to 0 and the other refitted through the data)."""
    x, y = np.asarray(tokens, float), np.asarray(seconds, float)
    if len(x) < 2 or np.ptp(x) == 0:
        return float(y.mean()) if len(y) else 0.0, 0.0
    b, a = np.polyfit(x, y, 1)
    if a < 0:
        return 0.0, float((x @ y) / (x @ x))
    if b < 0:
        return float(y.mean()), 0.0
    return float(a), float(b)


def fit_prepare_calls(rows: Sequence[dict]) -> tuple[float, float]:
    """Least squares ``s = pass_s * passes + token_s * padded_tokens`` over timed prepare calls
    (``measure_prepare_calls``' rows): ``(pass_s, token_s)``, both >= 0 (a negative term is noise:
    it is set to 0 and the other refitted through the data). No intercept: a call of one unit is
    one pass, so a per-call constant cannot be told apart from the per-pass one."""
    if not rows:
        raise ValueError("no timed prepare calls to fit")
    x = np.asarray([[r["passes"], r["padded_tokens"]] for r in rows], float)
    y = np.asarray([r["s"] for r in rows], float)
    (pass_s, token_s), *_ = np.linalg.lstsq(x, y, rcond=None)
    if pass_s < 0:
        return 0.0, float(x[:, 1] @ y / (x[:, 1] @ x[:, 1]))
    if token_s < 0:
        return float(x[:, 0] @ y / (x[:, 0] @ x[:, 0])), 0.0
    return float(pass_s), float(token_s)


CALLS_PER_SIZE = 4
"""Timed prepare calls per call size (consecutive units in completion order, like the stream
controller's calls); fewer where the iteration holds fewer units."""


def call_sizes(n_units: int) -> list[int]:
    """Call sizes to time, in units: powers of two below ``n_units``, and ``n_units`` (the whole
    iteration in one call, as disagg-batch and colocated prepare)."""
    return sorted({1 << k for k in range(max(1, n_units).bit_length()) if 1 << k < n_units} | {max(1, n_units)})


def measure_prepare_calls(tr, units: list[list], micro_batch_tokens: int, repeats: int = REPEATS) -> list[dict]:
    """Seconds of ``Trainer.prepare_groups`` (the live trainer's prepare: all units of a call in
    shared, length-sorted forward passes of ``micro_batch_tokens`` padded tokens) on calls of
    ``call_sizes`` units, median of ``repeats`` per call, with each call's passes and padded
    tokens (``sim.cost.micro_batch_shapes``, the trainer's cut rule)."""
    from streamrl.lab.sim.cost import micro_batch_shapes

    calls = [units[i * k:(i + 1) * k] for k in call_sizes(len(units)) for i in range(min(CALLS_PER_SIZE, len(units) // k))]
    runs: list[list[float]] = []
    for _ in range(max(1, repeats)):
        tr.begin_iteration()
        one = []
        for call in calls:
            t0 = time.perf_counter()
            tr.prepare_groups(call)
            one.append(time.perf_counter() - t0)
        runs.append(one)
    secs = np.median(np.asarray(runs), axis=0)
    rows = []
    for call, sec in zip(calls, secs):
        lens = [len(s.completion.prompt_ids) + len(s.completion.output_ids) for g in call for s in g]
        shapes = micro_batch_shapes(lens, micro_batch_tokens)
        rows.append({"units": len(call), "samples": len(lens), "tokens": sum(lens), "passes": len(shapes),
                     "padded_tokens": int(sum(r * m for r, m in shapes)), "s": float(sec)})
    return rows


def measure_train(cfg: Config, samples: list, threads: int, steps: int = 3, repeats: int = REPEATS) -> dict[str, float]:
    """Trainer costs at ``threads`` threads, on real samples, exactly as the live trainer works:
    ``prepare_groups`` once per call on the call's units (``live_units``), ``train_step`` per
    dynamic batch. Two measurements:

    * optimizer steps: one untimed warm-up step, then ``steps`` timed ones, each on a dynamic batch
      of ``trainer.step_tokens`` prepared in one call (``train_step_tokens_per_s``, and the
      combined ``train_tokens_per_s`` = tokens / (those prepares + steps));
    * prepare calls (``measure_prepare_calls``) of 1, 2, 4, ... units and of the whole iteration,
      fitted as ``prepare_s_per_pass * passes + prepare_s_per_padded_token * padded tokens``
      (``fit_prepare_calls``): the cost of a call of any size, which ``sim.cost.ProfiledTrain``
      charges."""
    from streamrl.trainer.trainer import Trainer, dynamic_batches

    tcfg = cfg.model_copy(deep=True)
    tcfg.trainer.threads = threads
    tr = Trainer(tcfg)
    units = live_units(samples, cfg.trainer.algo)
    batches = dynamic_batches(units, cfg.trainer.step_tokens, tokens=_sample_group_tokens)

    def one_step(batch: list[list]) -> tuple[float, float, int]:
        tr.begin_iteration()
        t0 = time.perf_counter()
        groups = tr.prepare_groups(batch)
        if cfg.trainer.algo == "grpo":
            tr.set_group_advantages(groups)
        t1 = time.perf_counter()
        tr.train_step([p for g in groups for p in g])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, sum(p.num_tokens for g in groups for p in g)

    one_step(batches[0])  # warm-up (allocator, first backward)
    timed = [batches[(k + 1) % len(batches)] for k in range(max(1, steps))]
    prep_runs: list[list[float]] = []
    step_runs: list[list[float]] = []
    switches = voluntary_switches()
    for _ in range(max(1, repeats)):  # the same batches each time; keep the median of each
        runs = [one_step(batch) for batch in timed]
        prep_runs.append([r[0] for r in runs])
        step_runs.append([r[1] for r in runs])
    tokens = sum(_sample_group_tokens(g) for batch in timed for g in batch)
    switches = (voluntary_switches() - switches) / max(1, repeats)
    prep = float(np.median(np.asarray(prep_runs), axis=0).sum())
    step = float(np.median(np.asarray(step_runs), axis=0).sum())
    calls = measure_prepare_calls(tr, units, cfg.trainer.micro_batch_tokens, repeats)
    pass_s, token_s = fit_prepare_calls(calls)
    return {"train_tokens_per_s": tokens / (prep + step), "prepare_s": prep, "train_step_s": step,
            "train_step_tokens_per_s": tokens / step, "prepare_unit": "group" if cfg.trainer.algo == "grpo" else "sample",
            "prepare_calls": calls, "prepare_s_per_pass": pass_s, "prepare_s_per_padded_token": token_s,
            "micro_batch_tokens": cfg.trainer.micro_batch_tokens,
            "tokens": tokens, "steps": max(1, steps), "step_tokens": cfg.trainer.step_tokens,
            "algo": cfg.trainer.algo, "threads": threads, "repeats": max(1, repeats), "statistic": "median of repeats",
            "voluntary_switches_per_repeat": switches}

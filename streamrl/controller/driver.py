"""`streamrl train`: the RL driver. It reads like the algorithm:

    start Ray; load the task; make sure the policy exists
    evaluate the held-out set
    for each iteration:  prompts -> pipeline.step (generate, score, train, push weights) -> log
    evaluate again; save a checkpoint; print the summary table

The mode (colocated, disagg-batch, stream-sync, stream-async) only changes ``pipeline``: one
object per mode with ``step`` / ``generate`` / ``save`` / ``load`` / ``shutdown``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from streamrl.config import Config, dump_config
from streamrl.controller.common import PromptStream, RequestBuilder, Scorer, length_stats
from streamrl.modes import get_mode
from streamrl.placement import PlacementPlan, check_cluster, plan_placement
from streamrl.tasks.factory import make_task

if TYPE_CHECKING:
    from streamrl.controller.pipelines import Pipeline

log = logging.getLogger(__name__)


def init_ray(cfg: Config) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ray.is_initialized():
        return
    env = {"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}}
    if cfg.cluster.address:
        if cfg.cluster.ship_package:  # other nodes import this copy of the package (controller.shipping)
            env["py_modules"] = [str(Path(__file__).resolve().parents[1])]  # the streamrl package folder
        ray.init(address=cfg.cluster.address, log_to_driver=True, runtime_env=env)
    else:
        ray.init(num_cpus=cfg.cluster.num_cpus, include_dashboard=False, log_to_driver=True, runtime_env=env)


def ray_resources() -> dict[str, float]:
    import ray

    return ray.cluster_resources()


def ensure_policy(cfg: Config, echo=print) -> None:
    """Build the tiny policy (tokenizer, model, SFT warm start) at its cache path if it is not on
    disk yet, or if the one there was built for an older version of the synthetic task (its
    ``streamrl_policy.json`` says so). Any other path must hold a checkpoint (or be a cached hub
    id): a mistyped path fails here, naming it, instead of training a tiny model there."""
    from streamrl.models.hf import is_tiny_policy_path, resolve_policy_path
    from streamrl.models.sft import POLICY_MARKER, policy_is_stale

    path = Path(cfg.policy.path)
    if (path / "config.json").is_file():
        if not policy_is_stale(path):
            return
        echo(f"the policy at {path} was built for an older synthetic task ({POLICY_MARKER}); rebuilding it")
    elif not (cfg.policy.make_if_missing and is_tiny_policy_path(path)):
        resolve_policy_path(path)  # a hub id in the local cache passes; anything else raises naming the path
        return
    from streamrl.models.sft import make_policy

    echo(f"building the tiny policy at {cfg.policy.path} (tokenizer, model, supervised warm start)")
    from streamrl.metrics import progress

    with progress.bar("building the tiny policy (SFT steps)", total=cfg.policy.sft_steps):
        res = make_policy(cfg.policy, cfg.policy.path, seed=cfg.run.seed, progress=lambda s, n, m: echo(m))
    echo(f"policy ready: {res.steps} SFT steps in {res.seconds:.0f}s, sampled accuracy {res.sampled_accuracy:.3f}")


def make_pipeline(cfg: Config, ctx: "RunContext", plan: PlacementPlan | None = None) -> "Pipeline":
    """The configured mode's pipeline; ``plan`` is the run's placement plan (computed here if not given)."""
    from streamrl.controller.pipelines import ColocatedPipeline, DisaggPipeline

    plan = plan if plan is not None else plan_placement(cfg)
    if get_mode(cfg.mode).colocated:
        return ColocatedPipeline(cfg, ctx, plan)
    return DisaggPipeline(cfg, ctx, plan)


class RunContext:
    """What every pipeline needs from the driver: request building and scoring."""

    def __init__(self, cfg: Config, task, tokenizer, reward_fn=None) -> None:
        from streamrl.tasks.rewards import RewardRunner

        self.cfg = cfg
        self.task = task
        self.tokenizer = tokenizer
        self.builder = RequestBuilder(tokenizer, cfg)
        self.reward_runner = RewardRunner.for_task(task, cfg.task, reward_fn=reward_fn)
        self.scorer = Scorer(task, tokenizer, self.reward_runner)
        self.fault_log: str | None = None  # where the SGS appends generation faults (the driver sets it)


def usable_prompts(cfg: Config, task, builder: RequestBuilder):
    """The task's train and eval prompts that fit: at most ``task.max_prompt_tokens`` tokens as
    the engine will see them (chat template included), and prompt + ``generation.max_new_tokens``
    within the policy's context. The rest are dropped here, once, counted and logged (never in
    the middle of a batch, so no batch is ever empty); if no training prompt fits, the run stops
    naming the limit. Returns ``(train, eval, metrics)``."""
    from streamrl.tasks.math import DataError

    limit, why = cfg.task.max_prompt_tokens, f"task.max_prompt_tokens={cfg.task.max_prompt_tokens}"
    context = _policy_context(cfg.policy.path)
    if context is not None and context - cfg.generation.max_new_tokens < limit:
        limit = context - cfg.generation.max_new_tokens
        why = (f"the policy's context {context} - generation.max_new_tokens={cfg.generation.max_new_tokens}")
    if limit < 1:
        raise DataError(f"generation.max_new_tokens={cfg.generation.max_new_tokens} leaves no room for a prompt in "
                        f"the policy's context ({context} tokens)")

    def fits(prompts, role: str):
        kept, over = [], []
        for p in prompts:
            (kept if len(builder.encode(p.text)) <= limit else over).append(p)
        for p in over[:5]:
            log.warning("%s prompt %s has %d tokens > %d (%s): not used", role, p.prompt_id,
                        len(builder.encode(p.text)), limit, why)
        if len(over) > 5:
            log.warning("... and %d more %s prompts over %d tokens", len(over) - 5, role, limit)
        return kept, len(over)

    train, n_train = fits(task.train_prompts(), "train")
    evals, n_eval = fits(task.eval_prompts(), "eval")
    if not train:
        raise DataError(f"every training prompt ({n_train}) is longer than {limit} tokens ({why})")
    if not evals:
        raise DataError(f"every held-out prompt ({n_eval}) is longer than {limit} tokens ({why})")
    report = task.load_report()
    metrics = {"data/train_prompts": float(len(train)), "data/eval_prompts": float(len(evals)),
               "data/oversized": float(n_train + n_eval), "data/prompt_token_limit": float(limit),
               **(report.metrics() if report is not None else {})}
    return train, evals, metrics


def _policy_context(path) -> int | None:
    """``max_position_embeddings`` of the policy's config.json, if it says."""
    from streamrl.models.hf import resolve_policy_path

    try:
        return int(json.loads((resolve_policy_path(path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def evaluate(pipeline, ctx: RunContext, prompts, samples_per_prompt: int, tag: str) -> dict[str, float]:
    """Held-out accuracy (mean verifiable reward at the training temperature) and lengths."""
    ctx.scorer.register(prompts)
    n_saved = ctx.builder.n
    ctx.builder.n = samples_per_prompt
    try:
        requests = ctx.builder.build(prompts, iteration=0, tag=f"eval-{tag}-")
    finally:
        ctx.builder.n = n_saved
    completions = pipeline.generate(requests)
    samples = [ctx.scorer.score(c, 0) for c in completions]
    lengths = [s.num_response_tokens for s in samples]
    return {"eval/accuracy": float(np.mean([s.reward >= 1.0 for s in samples])),
            "eval/reward": float(np.mean([s.reward for s in samples])), "eval/samples": len(samples),
            **length_stats(lengths, "eval/resp_len")}


def user_reward(cfg: Config, reward_fn=None):
    """The run's ``UserReward`` (``task.reward`` specs, then ``reward_fn`` callables), imported
    and signature-checked here so a typo fails before Ray starts; None = the task's verifier."""
    from streamrl.config import reward_specs
    from streamrl.tasks.user_reward import UserReward

    specs = reward_specs(cfg.task)
    fns = [] if reward_fn is None else (list(reward_fn) if isinstance(reward_fn, (list, tuple)) else [reward_fn])
    if not specs and not fns:
        return None
    weights = cfg.task.reward_weights
    if weights is not None and fns:
        weights = list(weights) + [1.0] * len(fns)
    return UserReward(specs, weights, fns).check()


def train(cfg: Config, echo=print, reward_fn=None, callbacks=()) -> dict[str, Any]:
    """One RL run as configured; ``reward_fn`` (a callable or a list, see ``tasks/user_reward.py``)
    adds to or replaces the task's verifier; each callback is called as ``cb(iteration, metrics)``
    after every iteration. Returns the summary (also written to ``run.out_dir/summary.json``).
    ``run.out_dir`` is locked for the run (``rundir.py``); Ctrl-C stops it after a checkpoint
    where one is exact (``RunInterrupted`` says which)."""
    from streamrl.config import ConfigError
    from streamrl.metrics.logger import check_backends

    try:
        check_backends(cfg.logging.backends)  # a backend whose package is missing fails before any work
    except ValueError as exc:
        raise ConfigError(f"logging.backends: {exc}") from None
    from streamrl.controller.rundir import RunDir

    plan = plan_placement(cfg)  # once, before any work: an impossible plan fails here, naming the keys
    reward = user_reward(cfg, reward_fn)
    rundir = RunDir(cfg.run.out_dir, resume=cfg.run.resume, overwrite=cfg.run.overwrite)  # locked for the run
    try:
        return _train(cfg, echo, reward, callbacks, plan, rundir)
    finally:
        rundir.close()


def _train(cfg: Config, echo, reward, callbacks, plan: PlacementPlan, rundir) -> dict[str, Any]:
    from streamrl.errors import GenerationFailed, RunInterrupted
    from streamrl.metrics.logger import MetricsLogger
    from streamrl.models.tiny import load_policy

    out = rundir.path
    (out / "config.yaml").write_text(dump_config(cfg))
    ensure_policy(cfg, echo)
    _, tokenizer = load_policy(cfg.policy.path)
    task = make_task(cfg)
    ctx = RunContext(cfg, task, tokenizer, reward)
    ctx.fault_log = str(out / "faults.jsonl")  # the SGS appends each fault as it happens
    train_prompts, eval_prompts, data_metrics = usable_prompts(cfg, task, ctx.builder)  # before Ray starts
    init_ray(cfg)
    check_cluster(plan, ray_resources())  # a pinned worker with no node to run on fails before any actor
    stream = PromptStream(train_prompts, seed=cfg.run.seed, shuffle=not getattr(task, "ordered", False))
    pipeline = make_pipeline(cfg, ctx, plan)
    (out / "placement.json").write_text(json.dumps(pipeline.locations(), indent=1) + "\n")  # where each worker ran
    start = 0
    ckpt = out / "checkpoint"
    if cfg.run.resume:  # RunDir has checked that the checkpoint exists
        extra = pipeline.load(str(ckpt))
        stream.load_state(extra["stream"])
        pipeline.restore_ranker(extra.get("ranker"))
        start = int(extra["iteration"]) + 1
        dropped = rundir.cut_metrics(start)  # rows past the checkpoint belong to the run that was stopped
        echo(f"resumed from {ckpt} at iteration {start}" + (f" ({dropped} later metric rows dropped)" if dropped else ""))
    logger = MetricsLogger(out, backends=cfg.logging.backends, echo=echo, config=cfg)
    sample_log = None
    if cfg.logging.samples:
        from streamrl.metrics.samples import SampleLog

        sample_log = SampleLog(out, start_iteration=start)
    if start == 0:
        logger.log(0, data_metrics, echo=False)  # what the data held, and what was left out
    before = evaluate(pipeline, ctx, eval_prompts, cfg.run.eval_samples, "before") if start == 0 else {}
    if before:
        echo(f"held-out before RL: accuracy {before['eval/accuracy']:.3f} on {before['eval/samples']} samples")
        logger.log(0, before, echo=False)
    pipeline.timeline.spill_to(out / "timeline.jsonl")  # events on disk as they come: the driver's memory stays flat
    t_run = time.time()
    done_it, done_stream = start - 1, stream.state()  # the last iteration whose step returned
    try:
        for it in range(start, cfg.run.iterations):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            upcoming = stream.upcoming(cfg.generation.prompts_per_iter, min(pipeline.lookahead, cfg.run.iterations - it - 1))
            samples, metrics = pipeline.step(it, prompts, upcoming)
            done_it, done_stream = it, stream.state()
            metrics.update(system_metrics())
            _log_iteration(cfg, it, samples, metrics, pipeline, ctx, eval_prompts, logger, sample_log, callbacks,
                           ckpt, stream, out)
    except (KeyboardInterrupt, GenerationFailed) as exc:  # the trainer is alive: keep what it trained, where exact
        try:
            message = _checkpoint_after_interrupt(pipeline, ckpt, done_it, start, done_stream)
        finally:
            _close_quietly(pipeline, sample_log, ctx, logger)
        if isinstance(exc, KeyboardInterrupt):
            raise RunInterrupted(message) from None
        raise GenerationFailed(f"{exc}; {message}") from None
    except BaseException:
        _close_quietly(pipeline, sample_log, ctx, logger)
        raise
    pipeline.finish()
    for trained_it, train_metrics in pipeline.unreported_train_metrics():
        logger.log(trained_it + 1, train_metrics, echo=False)  # async: the last steps finish after the loop
    rl_seconds = time.time() - t_run
    timeline = pipeline.timeline
    timeline.unspill()  # into memory for the pictures and stats; timeline.json holds every event
    pipe_stats: dict[str, Any] = {}
    if len(timeline):
        from streamrl.metrics.timeline import gantt

        timeline.to_json(out / "timeline.json")
        gantt(timeline, out / "gantt.png", title=f"{cfg.mode}: {cfg.run.iterations} iterations")
        pipe_stats = pipeline_stats(logger, timeline, rl_seconds, cfg.run.iterations - start)
        pipe_stats["gantt"] = str(out / "gantt.png")
    after = evaluate(pipeline, ctx, eval_prompts, cfg.run.eval_samples, "after")
    logger.log(cfg.run.iterations + 1, after, echo=False)
    pipeline.save(str(ckpt), _extra(pipeline, cfg.run.iterations - 1, stream.state()))
    lineage = pipeline.lineage()
    (out / "lineage.json").write_text(json.dumps(lineage))  # what the final weights were trained on
    final = export_policy(ckpt / "policy", out / "policy", save_dtype(cfg))
    rewards = logger.series["reward/mean"]
    summary = {"before": before, "after": after, "rl_seconds": rl_seconds, "iterations": cfg.run.iterations,
               "rewards": rewards, "reward_trend": reward_trend(rewards),
               "trained_samples": len(lineage), "trained_samples_unique": len(set(lineage)),
               "oversized_prompts": data_metrics["data/oversized"], "final_policy": str(final), "pipeline": pipe_stats}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    pipeline.shutdown()
    if sample_log is not None:
        sample_log.close()
    ctx.reward_runner.close()
    logger.close()
    echo(f"trained policy: {final} (a Hugging Face checkpoint: AutoModelForCausalLM.from_pretrained loads it)")
    return summary


def _log_iteration(cfg, it, samples, metrics, pipeline, ctx, eval_prompts, logger, sample_log, callbacks,
                   ckpt: Path, stream, out: Path) -> None:
    """After iteration ``it``'s step: rollout log, metrics, periodic evaluation, callbacks, checkpoint."""
    if sample_log is not None:
        sample_log.write(it, samples)
    metrics.update(_sample_metrics(samples))
    metrics.update(ctx.reward_runner.metrics())  # already reward/...
    if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and it + 1 < cfg.run.iterations:
        metrics.update(evaluate(pipeline, ctx, eval_prompts, cfg.run.eval_samples, f"it{it}"))
    logger.log(it + 1, metrics)
    for callback in callbacks:
        callback(it, metrics)
    if cfg.run.checkpoint_every and (it + 1) % cfg.run.checkpoint_every == 0:
        keep = str(out / "checkpoints" / f"iter-{it + 1}") if cfg.run.keep_checkpoints else None
        pipeline.checkpoint(str(ckpt), _extra(pipeline, it, stream.state()), keep_as=keep)


def system_metrics() -> dict[str, float]:
    """The driver's resident memory and open files, and the Ray object store's bytes and objects
    (read from the raylet; absent where Ray does not answer): what ``bench soak`` watches for leaks."""
    import resource

    out = {"sys/driver_rss_mb": rss_mb(os.getpid()), "sys/driver_open_files": float(len(os.listdir("/proc/self/fd")))
           if os.path.isdir("/proc/self/fd") else float("nan")}
    out["sys/driver_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        stats = get_memory_info_reply(get_state_from_address(None), timeout_seconds=5).store_stats
        out["sys/object_store_bytes"] = float(stats.object_store_bytes_used)
        out["sys/object_store_objects"] = float(stats.num_local_objects)
    except Exception:  # noqa: BLE001 - a private Ray API: the run never depends on it
        pass
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (/proc), NaN if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def _extra(pipeline, iteration: int, stream_state: dict) -> dict:
    """What a checkpoint keeps beside the trainer's state: where the run is, and the ranker's history."""
    return {"iteration": iteration, "stream": stream_state, "ranker": pipeline.ranker_state()}


def _checkpoint_after_interrupt(pipeline, ckpt: Path, done_it: int, start: int, done_stream: dict) -> str:
    """Save a checkpoint of iteration ``done_it`` if the trainer's state is exactly that (no
    step on the interrupted iteration); returns what happened, for the one-line message."""
    if done_it < start:
        return (f"stopped before iteration {start} finished; {ckpt} was left as it was"
                if (ckpt / "trainer.pt").is_file() else f"stopped before iteration {start} finished; no checkpoint")
    if not pipeline.can_checkpoint_at(done_it):
        return (f"stopped during iteration {done_it + 1}, after the trainer had stepped on part of it: no exact "
                f"checkpoint is possible, {ckpt} was left as it was")
    pipeline.save(str(ckpt), _extra(pipeline, done_it, done_stream))
    return f"checkpoint of iteration {done_it} saved in {ckpt}; continue with run.resume=true"


def _close_quietly(pipeline, sample_log, ctx, logger) -> None:
    """Stop the run's actors and close its files after a failure; the failure is what is reported."""
    for close in (pipeline.shutdown, getattr(sample_log, "close", None), ctx.reward_runner.close, logger.close):
        if close is None:
            continue
        try:
            close()
        except Exception as exc:  # noqa: BLE001 - already failing: log and go on closing the rest
            log.warning("while stopping after a failure: %s: %s", type(exc).__name__, exc)


def reward_trend(rewards: list[float]) -> dict[str, float]:
    """How the per-iteration training reward moved: means of the first and last thirds of the
    iterations and the least-squares slope per iteration (one batch of prompts is noisy; these
    are not)."""
    if len(rewards) < 3:
        return {}
    r = np.asarray(rewards, dtype=float)
    third = len(r) // 3
    slope = float(np.polyfit(np.arange(len(r)), r, 1)[0])
    return {"first_third_mean": float(r[:third].mean()), "last_third_mean": float(r[-third:].mean()),
            "slope_per_iter": slope}


def pipeline_stats(logger, timeline, rl_seconds: float, iterations: int) -> dict[str, float]:
    """How well the run overlapped its stages: ``efficiency`` = max(mean generation time, mean
    training time per iteration) / the measured step time (1.0 = the slower stage alone sets the
    pace, as with perfect overlap; colocated runs sit near gen / (gen + train)), and the busy
    fractions of the generation instances and the trainer over the run (from the timeline);
    ``logger`` gives the running means (``MetricsLogger.mean``)."""
    step_s = rl_seconds / max(iterations, 1)
    gen_s = logger.mean("time/gen_s")
    train_s = logger.mean("time/train_s") + (logger.mean("time/prepare_s") if logger.has("time/prepare_s") else 0.0)
    summary = timeline.summary()
    gen_rows = [r for r in timeline.rows() if r != "trainer"]
    busy = [summary.get(f"busy/{r}", 0.0) for r in gen_rows]
    return {"step_s": step_s, "gen_s": gen_s, "train_s": train_s,
            "efficiency": max(gen_s, train_s) / step_s if step_s > 0 else float("nan"),
            "gen_busy": float(np.mean(busy)) if busy else float("nan"), "train_busy": summary.get("busy/trainer", float("nan"))}


def save_dtype(cfg: Config) -> str:
    """``policy.save_dtype``, with auto = bfloat16 on GPU, float32 on CPU."""
    if cfg.policy.save_dtype != "auto":
        return cfg.policy.save_dtype
    return "bfloat16" if cfg.placement.device == "cuda" else "float32"


def export_policy(src: Path, dst: Path, dtype: str) -> Path:
    """The trained policy as a standard checkpoint at ``dst`` (model, tokenizer with its chat
    template, generation config) in ``dtype``; written beside, then moved into place."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if dtype == "float32":  # the trainer saves fp32 master weights
        shutil.copytree(src, tmp)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
        model.save_pretrained(tmp)
        for f in src.iterdir():
            if not (tmp / f.name).exists() and f.is_file():
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst


def _sample_metrics(samples) -> dict[str, float]:
    lengths = [s.num_response_tokens for s in samples]
    rewards = [s.reward for s in samples]
    m = {"reward/mean": float(np.mean(rewards)) if rewards else 0.0, "batch/samples": len(samples),
         "reward/accuracy": float(np.mean([r >= 1.0 for r in rewards])) if rewards else 0.0,
         "reward/errors_in_iter": sum(1 for s in samples if s.reward_info.get("error"))}
    components: dict[str, list[float]] = {}
    for smp in samples:
        for name, value in smp.reward_info.get("components", {}).items():
            components.setdefault(name, []).append(value)
    m.update({f"reward/component/{k}": float(np.mean(v)) for k, v in components.items()})
    m.update(length_stats(lengths))
    m["resp_len/truncated_frac"] = float(np.mean([s.completion.finish_reason == "length" for s in samples])) if samples else 0.0
    return m

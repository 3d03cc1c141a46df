"""One RL run as an object: ``setup`` (policy, task, prompts, Ray, pipeline, resume, evaluation
before), ``loop`` (prompts -> ``pipeline.step`` -> log, evaluate, checkpoint) and ``finish``
(last training steps, pictures, evaluation after, final checkpoint, export, summary).

The mode only changes ``pipeline``. Ctrl-C stops the run after the current step with a checkpoint,
a second Ctrl-C at once (``controller/interrupts.py``); a generation failure stops it after a
checkpoint where one is exact (``Checkpoints.after_interrupt``). Every actor and file is closed on
any failure, and the failure is what is reported.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from streamrl.config import Config, dump_config
from streamrl.controller.checkpoints import Checkpoints
from streamrl.controller.common import PromptStream
from streamrl.controller.evaluation import evaluate
from streamrl.controller.export import export_merged, export_policy, save_dtype
from streamrl.controller.prompts import usable_prompts
from streamrl.controller.setup import RunContext, ensure_policy, init_ray, make_pipeline, ray_resources
from streamrl.controller.stats import pipeline_stats, reward_trend, sample_metrics, system_metrics
from streamrl.placement import PlacementPlan, check_cluster
from streamrl.tasks.factory import make_task

log = logging.getLogger(__name__)


class Run:
    def __init__(self, cfg: Config, echo, reward, callbacks, plan: PlacementPlan, rundir) -> None:
        self.cfg, self.echo, self.reward, self.callbacks, self.plan = cfg, echo, reward, callbacks, plan
        self.rundir, self.out = rundir, rundir.path
        self.start = 0  # the first iteration this process runs (after a resume: the one after the checkpoint)
        self.sample_log = None
        self.before: dict = {}

    def setup(self) -> None:
        from streamrl.memory import watch_private_memory
        from streamrl.metrics.logger import MetricsLogger
        from streamrl.models.tiny import load_tokenizer

        watch_private_memory()  # the driver's private peak, as every actor's
        cfg, out = self.cfg, self.out
        ensure_policy(cfg, self.echo)
        from streamrl.controller.preflight import check_fits
        from streamrl.models.hf import resolve_policy_path

        policy_path = resolve_policy_path(cfg.policy.path)
        check_fits(cfg, policy_path)  # before Ray: a model that cannot fit stops here
        if cfg.trainer.lora.rank > 0:  # before Ray: an adapter on a module the model lacks stops here
            from streamrl.models.lora import check_targets

            check_targets(cfg, policy_path)
        (out / "config.yaml").write_text(dump_config(cfg))  # once the checks pass: a refused run leaves nothing
        tokenizer = load_tokenizer(cfg.policy.path)
        task = make_task(cfg)
        self.ctx = RunContext(cfg, task, tokenizer, self.reward)
        self.ctx.fault_log = str(out / "faults.jsonl")  # the SGS appends each fault as it happens
        train_prompts, self.eval_prompts, self.data_metrics = usable_prompts(cfg, task, self.ctx.builder)  # before Ray
        init_ray(cfg)
        check_cluster(self.plan, ray_resources())  # a pinned worker with no node to run on fails before any actor
        self.stream = PromptStream(train_prompts, seed=cfg.run.seed, shuffle=not getattr(task, "ordered", False))
        self.pipeline = make_pipeline(cfg, self.ctx, self.plan)
        (out / "placement.json").write_text(json.dumps(self.pipeline.locations(), indent=1) + "\n")  # where each ran
        self.checkpoints = Checkpoints(self.pipeline, out, cfg.run.checkpoint_every, cfg.run.keep_checkpoints)
        if cfg.run.resume:  # RunDir has checked that the checkpoint exists
            self.start = self.checkpoints.resume(self.stream)
            dropped = self.rundir.cut_metrics(self.start)  # rows past the checkpoint belong to the run that was stopped
            self.echo(f"resumed from {self.checkpoints.path} at iteration {self.start}"
                      + (f" ({dropped} later metric rows dropped)" if dropped else ""))
        self.logger = MetricsLogger(out, backends=cfg.logging.backends, echo=self.echo, config=cfg)
        if cfg.logging.samples:
            from streamrl.metrics.samples import SampleLog

            self.sample_log = SampleLog(out, start_iteration=self.start)
        if self.start == 0:
            self.logger.log(0, self.data_metrics, echo=False)  # what the data held, and what was left out
            self.before = self._evaluate("before")
            self.echo(f"held-out before RL: accuracy {self.before['eval/accuracy']:.3f} on "
                      f"{self.before['eval/samples']} samples")
            self.logger.log(0, self.before, echo=False)
        self.pipeline.timeline.spill_to(out / "timeline.jsonl")  # events on disk as they come: flat driver memory

    def _evaluate(self, tag: str) -> dict[str, float]:
        return evaluate(self.pipeline, self.ctx, self.eval_prompts, self.cfg.run.eval_samples, tag)

    def loop(self) -> float:
        """Every iteration from ``start``; returns the loop's seconds."""
        from streamrl.controller.interrupts import GracefulStop
        from streamrl.errors import GenerationFailed, RunInterrupted

        cfg, t_run = self.cfg, time.time()
        done_it, done_stream = self.start - 1, self.stream.state()  # the last iteration whose step returned
        try:
            with GracefulStop(self.echo) as stop:
                for it in range(self.start, cfg.run.iterations):
                    if stop.requested:  # the trainer ends what it was given, then done_it is saved if exact
                        message = self.checkpoints.after_interrupt(done_it, self.start, done_stream)
                        self.close_quietly()
                        raise RunInterrupted(message)
                    prompts = self.stream.next_batch(cfg.generation.prompts_per_iter)
                    self.ctx.scorer.register(prompts)
                    upcoming = self.stream.upcoming(cfg.generation.prompts_per_iter,
                                                    min(self.pipeline.lookahead, cfg.run.iterations - it - 1))
                    samples, metrics = self.pipeline.step(it, prompts, upcoming)
                    done_it, done_stream = it, self.stream.state()
                    metrics.update(system_metrics())
                    self._after_iteration(it, samples, metrics)
        except RunInterrupted:
            raise
        except KeyboardInterrupt:  # a second Ctrl-C (or one outside the graceful handler): stop now, save nothing
            self.close_quietly()
            raise RunInterrupted(self.checkpoints.kept()) from None
        except GenerationFailed as exc:  # the trainer is alive: keep what it trained, where exact
            try:
                message = self.checkpoints.after_interrupt(done_it, self.start, done_stream)
            finally:
                self.close_quietly()
            raise GenerationFailed(f"{exc}; {message}") from None
        except BaseException:
            self.close_quietly()
            raise
        return time.time() - t_run

    def _after_iteration(self, it: int, samples, metrics: dict) -> None:
        """Rollout log, metrics, periodic evaluation, callbacks, checkpoint."""
        cfg = self.cfg
        if self.sample_log is not None:
            self.sample_log.write(it, samples)
        metrics.update(sample_metrics(samples))
        metrics.update(self.ctx.reward_runner.metrics())  # already reward/...
        if cfg.run.eval_every and (it + 1) % cfg.run.eval_every == 0 and it + 1 < cfg.run.iterations:
            metrics.update(self._evaluate(f"it{it}"))
        self.logger.log(it + 1, metrics)
        for callback in self.callbacks:
            callback(it, metrics)
        self.checkpoints.after_iteration(it, self.stream.state())

    def finish(self, rl_seconds: float) -> dict[str, Any]:
        cfg, out, pipeline = self.cfg, self.out, self.pipeline
        t_drain = time.time()
        pipeline.finish()
        rl_seconds += time.time() - t_drain  # async modes train their last steps here: RL time includes them
        for trained_it, train_metrics in pipeline.unreported_train_metrics():
            self.logger.log(trained_it + 1, train_metrics, echo=False)  # async: the last steps finish after the loop
        pipe_stats = self._pictures(rl_seconds)
        after = self._evaluate("after")
        self.logger.log(cfg.run.iterations + 1, after, echo=False)
        self.checkpoints.final(cfg.run.iterations - 1, self.stream.state())
        lineage = pipeline.lineage()
        (out / "lineage.json").write_text(json.dumps(lineage))  # what the final weights were trained on
        final = export_policy(self.checkpoints.path / "policy", out / "policy", save_dtype(cfg))
        merged = None
        if cfg.trainer.lora.rank > 0 and cfg.trainer.lora.export_merged:
            from streamrl.models.hf import resolve_policy_path

            merged = export_merged(resolve_policy_path(cfg.policy.path), final, out / "policy-merged", save_dtype(cfg))
        rewards = self.logger.series["reward/mean"]
        summary = {"before": self.before, "after": after, "rl_seconds": rl_seconds, "iterations": cfg.run.iterations,
                   "rewards": rewards, "reward_trend": reward_trend(rewards),
                   "trained_samples": len(lineage), "trained_samples_unique": len(set(lineage)),
                   "oversized_prompts": self.data_metrics["data/oversized"], "final_policy": str(final),
                   "pipeline": pipe_stats}
        summary["peak_memory_mb"], summary["peak_private_mb"] = self._peak_memory()
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        pipeline.shutdown()
        if self.sample_log is not None:
            self.sample_log.close()
        self.ctx.close()
        self.logger.close()
        if cfg.trainer.lora.rank > 0:
            self.echo(f"trained adapter: {final} (peft: PeftModel.from_pretrained(base, path) loads it)"
                      + (f"; merged policy: {merged}" if merged else ""))
        else:
            self.echo(f"trained policy: {final} (a Hugging Face checkpoint: AutoModelForCausalLM.from_pretrained loads it)")
        return summary

    def _peak_memory(self) -> tuple[dict[str, float], dict[str, float]]:
        """Each process's peak resident memory, driver included, and the peak of its private
        memory where sampled (``memory.watch_private_memory``), echoed as one line."""
        from streamrl.memory import peaks_mb

        peaks = {**self.pipeline.peak_memory(), "driver": peaks_mb()}
        self.echo("peak memory: " + ", ".join(
            f"{name} {p['resident'] / 1024:.2f} GB" + (f" (private {p['private'] / 1024:.2f})" if "private" in p else "")
            for name, p in peaks.items()))
        return ({name: p["resident"] for name, p in peaks.items()},
                {name: p["private"] for name, p in peaks.items() if "private" in p})

    def _pictures(self, rl_seconds: float) -> dict[str, Any]:
        """timeline.json, the Gantt chart and the overlap statistics (empty without events)."""
        timeline = self.pipeline.timeline
        timeline.unspill()  # into memory for the pictures and stats; timeline.json holds every event
        if not len(timeline):
            return {}
        from streamrl.metrics.timeline import gantt

        timeline.to_json(self.out / "timeline.json")
        gantt(timeline, self.out / "gantt.png", title=f"{self.cfg.mode}: {self.cfg.run.iterations} iterations")
        stats = pipeline_stats(self.logger, timeline, rl_seconds, self.cfg.run.iterations - self.start)
        stats["gantt"] = str(self.out / "gantt.png")
        return stats

    def close_quietly(self) -> None:
        """Stop the run's actors and close its files after a failure; the failure is what is reported."""
        for close in (self.pipeline.shutdown, getattr(self.sample_log, "close", None), self.ctx.close,
                      self.logger.close):
            if close is None:
                continue
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - already failing: log and go on closing the rest
                log.warning("while stopping after a failure: %s: %s", type(exc).__name__, exc)


def run_training(cfg: Config, echo, reward, callbacks, plan: PlacementPlan, rundir) -> dict[str, Any]:
    run = Run(cfg, echo, reward, callbacks, plan, rundir)
    run.setup()
    return run.finish(run.loop())


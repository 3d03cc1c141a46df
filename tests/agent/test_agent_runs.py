"""Multi-turn trajectories live: Ray, real engines, a real trainer, the scripted chain env on the
tiny policy. Each trajectory is returned and trained once through an instance kill, its env
tokens are masked, every token keeps the version that sampled it within the staleness bound, and
``train(...)`` logs each trajectory's turns, env tokens and tool calls."""

from __future__ import annotations

import json

import pytest

from streamrl.config import load_config
from tests.helpers import kill_an_instance_at

pytestmark = pytest.mark.slow  # Ray instances with engines, a trainer

CHAIN_ENV = "streamrl.agent.scripted:ChainEnv"


def _mask_runs(mask) -> int:
    """How many runs of sampled tokens (1s) a loss mask holds: one per turn that sampled any."""
    return sum(1 for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1]))


def test_trajectories_stream_train_once_through_a_kill_with_masks_and_versions(ray_session, tiny_policy_dir):
    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.factory import make_task

    k = 2
    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "mode=stream-async", f"trainer.max_staleness={k}",
                             "generation.partial_rollout=true", "generation.max_new_tokens=48", "generation.n_samples=2",
                             "generation.prompts_per_iter=4", "generation.max_requests_per_batch=4", "task.num_eval=4",
                             f"task.env={CHAIN_ENV}", "task.env_workers=2"])
    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=0)
    kill_an_instance_at(ctx, pipe, 1)  # at iteration 1's first trajectory back: the others are mid-way
    samples = []
    try:
        for it in range(3):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            got, metrics = pipe.step(it, prompts, stream.upcoming(4, min(pipe.lookahead, 3 - it - 1)))
            samples += got
        pipe.finish()
        trained = pipe.trained_ids()
        counters = dict(pipe.sgs.counters)
        recent = list(pipe.sgs._recent)  # the lengths dispatch and the ranker learn from
    finally:
        pipe.shutdown()
        ctx.close()
    ids = [s.completion.request_id for s in samples]
    assert len(ids) == 3 * 4 * 2 and len(set(ids)) == len(ids) and sorted(trained) == sorted(ids)
    assert counters["sgs/faults"] == 1 and metrics["agent/trajectories"] >= len(ids)
    assert sorted(recent) == sorted(s.completion.generated for s in samples)  # a trajectory's sampled tokens
    multi = 0
    for s in samples:
        c, e = s.completion, s.completion.episode
        mask = c.mask()
        assert len(mask) == len(c.output_ids) == len(c.logprobs) == len(c.versions())
        assert mask.count(0) == e["env_tokens"] and s.num_response_tokens == mask.count(1) <= 48
        assert 1 <= e["turns"] <= 4 and e["tool_calls"] == 0
        if e["cut"] is None and e["error"] is None:
            assert _mask_runs(mask) == e["turns"] and e["env_tokens"] > 0 or e["turns"] == 1
        multi += e["turns"] > 1
        sampled = [v for v, m in zip(c.versions(), mask) if m]
        assert s.iteration - min(sampled) <= k  # the bound holds across turns
        assert all(lp == 0.0 for lp, m in zip(c.logprobs, mask) if not m)
        assert 0.0 <= s.reward <= 1.0 and "env_reward" in e
    assert multi >= 4  # trajectories with several turns happened


def test_train_logs_turns_on_one_instance_env_tokens_and_counts_a_failing_env(ray_session, tiny_policy_dir, tmp_path):
    from streamrl import train

    env = tmp_path / "flaky_env.py"
    env.write_text("from streamrl.agent.scripted import ChainEnv\n\n\n"
                   "class Flaky(ChainEnv):\n"
                   "    def step(self, text):\n"
                   "        if self.prompts[0].endswith('1:'):\n"
                   "            raise RuntimeError('flaky env')\n"
                   "        return super().step(text)\n")
    summary = train(overrides=[f"policy.path={tiny_policy_dir}", "mode=stream-sync", "run.iterations=2",
                               f"run.out_dir={tmp_path / 'run'}", "generation.max_new_tokens=32", "generation.n_samples=2",
                               "generation.prompts_per_iter=4", "task.num_eval=4", "run.eval_samples=1",
                               "logging.samples=true", f"task.env={env}:Flaky", "task.max_turns=2",
                               "generation.num_instances=2", "generation.cpus_per_instance=0.5"], echo=lambda m: None)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2 and summary["trained_samples_unique"] == len(rows)
    for r in rows:
        assert r["turns"] >= 1 and r["tool_calls"] == 0 and r["loss_mask"].count(0) == r["env_tokens"]
        assert r["cut"] in (None, "max_turns", "max_new_tokens")
        assert len(r["turn_instances"]) == r["turns"] and len(set(r["turn_instances"])) == 1  # its turns on one instance
    assert {i for r in rows for i in r["turn_instances"]} == {"gen-0", "gen-1"}
    assert any(r["turns"] > 1 for r in rows)
    failed = [r for r in rows if r["reward_error"]]
    assert all(r["reward"] == 0.0 and "flaky env" in r["reward_error"] for r in failed)
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # counted (held-out evaluation's trajectories count too: the counter is the run's)
    assert failed and max(m.get("agent/env_errors", 0) for m in metrics) >= len(failed)

"""Bounded staleness k, partial rollout and look-ahead admission, live: Ray, real engines, a
real trainer. The bound is what the trainer actor enforces (``StalenessError`` otherwise) and
what each returned sample shows (its oldest token's version)."""

from __future__ import annotations

import random
import threading

import pytest

from streamrl.config import load_config

pytestmark = pytest.mark.slow  # Ray instances with engines, a trainer


def _cfg(policy_dir, *overrides):
    return load_config(None, [f"policy.path={policy_dir}", "mode=stream-async", "generation.max_new_tokens=24",
                              "generation.n_samples=2", "generation.prompts_per_iter=4",
                              "generation.max_requests_per_batch=2", "task.num_eval=4", *overrides])


def _run(cfg, iterations: int, straggle_seed: int | None = None):
    """``iterations`` steps of a fresh pipeline, as the driver runs them; with ``straggle_seed``,
    a thread parks a random instance's engine for 0.05-0.4 s at random moments throughout
    (randomised generation delays). Returns (per step: samples, metrics), the trained ids and
    the pipeline's look-ahead."""
    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.factory import make_task

    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=0)
    stop = threading.Event()

    def straggle():
        rng = random.Random(straggle_seed)
        while not stop.wait(rng.uniform(0.05, 0.3)):
            names = list(pipe.sgs.instances)
            if names:
                pipe.sgs.instances[rng.choice(names)].inject_fault.remote(f"slow:{rng.uniform(0.05, 0.4):.3f}")

    thread = threading.Thread(target=straggle, daemon=True) if straggle_seed is not None else None
    steps = []
    try:
        if thread is not None:
            thread.start()
        for it in range(iterations):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            upcoming = stream.upcoming(cfg.generation.prompts_per_iter, min(pipe.lookahead, iterations - it - 1))
            steps.append(pipe.step(it, prompts, upcoming))
        stop.set()
        pipe.finish()
        trained = pipe.trained_ids()
        lookahead = pipe.lookahead
    finally:
        stop.set()
        pipe.shutdown()
        ctx.reward_runner.close()
    return steps, trained, lookahead


@pytest.mark.parametrize("k,partial", [(1, True), (2, False), (2, True), (4, True)])
def test_the_staleness_bound_holds_under_random_generation_delays(ray_session, tiny_policy_dir, k, partial):
    cfg = _cfg(tiny_policy_dir, f"trainer.max_staleness={k}", f"generation.partial_rollout={str(partial).lower()}")
    steps, trained, lookahead = _run(cfg, iterations=5, straggle_seed=k)
    sent = [s.completion.request_id for samples, _ in steps for s in samples]
    assert len(sent) == 5 * 4 * 2 and sorted(trained) == sorted(sent)  # every sample trained exactly once
    worst = 0
    for it, (samples, metrics) in enumerate(steps):
        for s in samples:
            c = s.completion
            versions = c.versions()
            assert s.iteration == it and len(versions) == len(c.output_ids)
            assert list(versions) == sorted(versions) and versions[0] == c.version_start  # oldest token first
            worst = max(worst, it - c.version_start)
        assert metrics["staleness/max"] <= k
    assert worst <= k  # the trainer (which trains iteration it at version it) checked the same
    assert lookahead == (k if partial else 1)
    if partial and k >= 2:  # iteration 1 may start before version 0 is superseded: look-ahead happened
        assert sum(m.get("gen/admitted_ahead", 0) for _, m in steps) > 0


def test_one_step_without_partial_rollout_is_the_stream_async_schedule(ray_session, tiny_policy_dir):
    """k = 1 with partial rollout off runs today's stream-async: iteration i generates with
    version i - 1 exactly (never a fresher one), nothing is admitted ahead, no response spans a
    weight update, and the same requests are trained."""
    default, trained_default, _ = _run(_cfg(tiny_policy_dir), iterations=4)
    explicit, trained_explicit, lookahead = _run(_cfg(tiny_policy_dir, "trainer.max_staleness=1"), iterations=4)
    for steps in (default, explicit):
        assert [m["gen/version"] for _, m in steps] == [0, 0, 1, 2]
        assert all("gen/admitted_ahead" not in m for _, m in steps)
        assert all(not s.completion.token_versions for samples, _ in steps for s in samples)
    assert sorted(trained_default) == sorted(trained_explicit) and lookahead == 1


def test_token_versions_survive_a_weight_update_and_a_migration_with_prefix(ray_session, tiny_policy_dir):
    """Weights change while requests run (partial rollout), then an instance is retired and its
    running requests continue elsewhere from their prefix: each joined response still says, per
    token, which version sampled it."""
    from tests.controller.test_faults import _busiest, _handle, _requests

    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.max_new_tokens=64"), hold_back=True)
    sgs.add_instances(2)
    sgs.update(_handle(tiny_policy_dir, 0), 0)
    requests = _requests(tiny_policy_dir, 12)
    done, moved = [], None
    try:
        for c in sgs.generate(requests):
            done.append(c)
            if len(done) == 1:
                sgs.update(_handle(tiny_policy_dir, 1), 1)  # mid-flight
            elif moved is None:
                moved = sgs.retire_instance(_busiest(sgs))
        counters = dict(sgs.counters)
    finally:
        sgs.shutdown()
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)
    for c in done:
        v = c.versions()
        assert len(v) == len(c.output_ids) and list(v) == sorted(v) and set(v) <= {0, 1}
    assert any(set(c.versions()) == {0, 1} for c in done)  # responses that span the update
    assert moved >= 1 and counters["sgs/rebalanced_running"] >= 1

"""Generation faults, for real: instance processes are killed (SIGKILL) or frozen (SIGSTOP) from
outside while they work or idle, and the weights' owner dies. Nothing is lost or returned twice,
a replacement installs the current weights, and a failure beyond the restart budget is named."""

from __future__ import annotations

import os
import signal

import pytest

from streamrl.config import load_config
from streamrl.errors import GenerationFailed, TrainerFailed
from tests.helpers import assert_the_stalled_instance_was_replaced, generate_stalling_the_busiest, kill_an_instance_at

pytestmark = pytest.mark.slow  # Ray instances with engines


def _cfg(policy_dir, *overrides):
    return load_config(None, [f"policy.path={policy_dir}", "generation.max_new_tokens=24", "generation.n_samples=2",
                              "generation.max_requests_per_batch=2", "task.num_eval=4", *overrides])


def _requests(policy_dir, n_prompts: int, tag: str = ""):
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.synthetic import SyntheticTask

    _, tok = load_policy(policy_dir)
    prompts = SyntheticTask(num_train=n_prompts, num_eval=1, seed=1).train_prompts()
    return RequestBuilder(tok, _cfg(policy_dir)).build(prompts, iteration=0, tag=tag)


def _handle(policy_dir, version: int):
    """A weight handle as the trainer publishes one (this process owns it)."""
    from streamrl.models.tiny import load_policy
    from streamrl.weights.flat import flatten
    from streamrl.weights.transfer import RayObjectStoreTransport

    model, _ = load_policy(policy_dir)
    return RayObjectStoreTransport().publish(flatten(model.state_dict(), version))


def _pid(sgs, name: str) -> int:
    import ray

    return ray.get(sgs.instances[name].pid.remote())


def _busiest(sgs) -> str:
    left = sgs.ledger.counts(sgs.instances)
    return max(left, key=left.get)


def _generate_and_hit(sgs, requests, hit) -> list[str]:
    """Every request's id as it comes back; ``hit(victim_pid)`` is applied once, after the first
    completion, to the process of the instance with the most unfinished requests."""
    seen, victim = [], None
    for c in sgs.generate(requests):
        seen.append(c.request_id)
        if victim is None:
            victim = _busiest(sgs)
            hit(_pid(sgs, victim))
    return seen


def test_an_instance_killed_while_generating_loses_nothing_and_is_replaced(ray_session, tiny_policy_dir):
    import ray

    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir))
    sgs.add_instances(2)
    sgs.update(_handle(tiny_policy_dir, 3), 3)
    requests = _requests(tiny_policy_dir, 12)
    try:
        seen = _generate_and_hit(sgs, requests, lambda pid: os.kill(pid, signal.SIGKILL))
        versions = ray.get([a.version.remote() for a in sgs.instances.values()])
    finally:
        sgs.shutdown()
    assert sorted(seen) == sorted(r.request_id for r in requests)  # none lost, none twice
    assert sgs.counters["sgs/faults"] == 1 and sgs.counters["sgs/requeued"] >= 1
    assert sgs.faults[0]["requeued"] == sgs.counters["sgs/requeued"] and "died" in sgs.faults[0]["reason"]
    assert sgs.counters["sgs/restarts"] == 1 and sgs.counters["sgs/instances_added"] == 3
    assert versions == [3, 3]  # the replacement installed the current weights before taking work
    assert sgs.take_metrics()["sgs/faults"] == 1.0


def test_an_idle_instance_that_died_does_not_break_the_next_weight_update(ray_session, tiny_policy_dir):
    import ray

    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.restart=false"))
    try:
        first, second = sgs.add_instances(2)
        os.kill(_pid(sgs, first), signal.SIGKILL)  # no work: only the update will meet it
        sgs.update(_handle(tiny_policy_dir, 1), 1)
        assert list(sgs.instances) == [second] and ray.get(sgs.instances[second].version.remote()) == 1
        requests = _requests(tiny_policy_dir, 3, tag="after-")
        assert sorted(c.request_id for c in sgs.generate(requests)) == sorted(r.request_id for r in requests)
    finally:
        sgs.shutdown()
    assert sgs.counters["sgs/faults"] == 1 and sgs.counters["sgs/restarts"] == 0


def test_a_frozen_instance_is_found_by_the_heartbeat_and_its_work_moves(ray_session, tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.heartbeat_timeout_s=3", "generation.restart=false"))
    sgs.add_instances(2)
    requests = _requests(tiny_policy_dir, 12)
    frozen = []

    def freeze(pid):
        os.kill(pid, signal.SIGSTOP)  # alive but silent: a hung engine
        frozen.append(pid)

    try:
        seen = _generate_and_hit(sgs, requests, freeze)
    finally:
        for pid in frozen:  # the SGS kills it; make sure of it even if the test fails first
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        sgs.shutdown()
    assert sorted(seen) == sorted(r.request_id for r in requests)
    assert sgs.counters["sgs/faults"] == 1 and "answered no" in sgs.faults[0]["reason"]
    assert sgs.counters["sgs/requeued"] >= 1 and len(sgs.instances) == 0  # shut down


def test_losing_the_last_instance_with_no_restart_left_stops_with_a_named_error(ray_session, tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.max_restarts=0"))
    sgs.add_instance()
    try:
        with pytest.raises(GenerationFailed, match="every generation instance is gone.*max_restarts=0"):
            _generate_and_hit(sgs, _requests(tiny_policy_dir, 6), lambda pid: os.kill(pid, signal.SIGKILL))
    finally:
        sgs.shutdown()


def _wait_until_lost(ref, timeout_s: float = 60.0) -> None:
    """ray.kill is asynchronous, and Ray learns of an owner's death a little later still."""
    import time

    import ray

    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            ray.get(ref, timeout=10)
        except ray.exceptions.OwnerDiedError:
            return
        time.sleep(0.5)
    raise AssertionError(f"{ref} still readable {timeout_s}s after its owner was killed")


def test_weights_whose_trainer_died_are_reported_as_a_trainer_failure(ray_session, tiny_policy_dir):
    import ray

    from streamrl.sgs.service import StreamGenerationService
    from streamrl.trainer.actor import TrainerActor

    cfg = _cfg(tiny_policy_dir)
    trainer = TrainerActor.options(num_cpus=0).remote(cfg, 1, 0)
    handle = ray.get(trainer.publish.remote())  # the trainer actor owns the buffer
    sgs = StreamGenerationService(cfg)
    sgs.add_instance()
    try:
        ray.kill(trainer)
        _wait_until_lost(handle.payload)
        with pytest.raises(TrainerFailed, match="trainer that published them died"):
            sgs.update(handle, 1)
        assert sgs.counters["sgs/faults"] == 0  # generation is not blamed
    finally:
        sgs.shutdown()


def test_children_of_a_relay_that_died_after_publishing_fetch_from_the_trainer(ray_session, tiny_policy_dir):
    """A relay re-publishes its copy for the instances below it; killed after that, its copy is
    gone with it. Its child then fetches the trainer's buffer (still alive) and installs the
    version: the run goes on, and only the relay counts as lost."""
    import ray

    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.restart=false"))
    try:
        relay, child = sgs.add_instances(2)
        handle = _handle(tiny_policy_dir, 1)
        relay_ref = sgs.pool[relay].actor.update.remote(handle, 1, True)
        relayed = ray.get(relay_ref)["handle"]  # the relay's own copy, owned by its process
        os.kill(_pid(sgs, relay), signal.SIGKILL)
        _wait_until_lost(relayed.payload)
        refs = {relay: relay_ref, child: sgs.pool[child].actor.update.remote(relay_ref, 1, False)}
        sgs._gather_tree(refs, {relay: None, child: relay}, handle, 1)
        assert ray.get(sgs.pool[child].actor.version.remote()) == 1
    finally:
        sgs.shutdown()
    assert sgs.counters["sgs/relay_fallbacks"] == 1


@pytest.mark.parametrize("mode", ["stream-async", "stream-sync"])
def test_pipeline_trains_every_sample_once_through_instance_kills(ray_session, tiny_policy_dir, mode):
    """The instance is killed while idle between iterations (met by the next submit or weight
    update), and its replacement right after the first sample of a later iteration is scored
    (met by a poll, with the rest of that iteration unfinished). Two CPUs hold the trainer and
    one instance, so each replacement starts in the CPU its predecessor freed."""
    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.factory import make_task

    cfg = _cfg(tiny_policy_dir, f"mode={mode}", "generation.prompts_per_iter=6")
    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=0)
    kill_an_instance_at(ctx, pipe, 2)  # the scorer sees each completion as it streams in
    sent = []
    try:
        for it in range(4):
            if it == 1:
                os.kill(_pid(pipe.sgs, next(iter(pipe.sgs.instances))), signal.SIGKILL)
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            samples, metrics = pipe.step(it, prompts)
            sent.extend(s.completion.request_id for s in samples)
        pipe.finish()
        trained = pipe.trained_ids()
        counters = dict(pipe.sgs.counters)
    finally:
        pipe.shutdown()
    assert len(sent) == 4 * 6 * 2 and len(set(sent)) == len(sent)  # every request returned once
    assert sorted(trained) == sorted(sent)  # and trained exactly once
    assert counters["sgs/faults"] == 2 and counters["sgs/restarts"] == 2 and counters["sgs/requeued"] >= 1
    assert metrics["sgs/faults"] == 2.0 and metrics["sgs/instances"] == 1.0


def test_retiring_an_instance_mid_generation_moves_its_work_with_prefixes_and_loses_nothing(ray_session,
                                                                                             tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.max_new_tokens=64"), hold_back=True)
    sgs.add_instances(2)
    requests = _requests(tiny_policy_dir, 12)
    seen, moved = [], None
    try:
        for c in sgs.generate(requests):
            seen.append(c.request_id)
            if moved is None:
                moved = sgs.retire_instance(_busiest(sgs))
    finally:
        sgs.shutdown()
    assert sorted(seen) == sorted(r.request_id for r in requests)
    assert moved >= 1 and sgs.counters["sgs/instances_removed"] == 1 and sgs.counters["sgs/faults"] == 0


def test_the_elastic_controller_adds_and_retires_instances_between_iterations(ray_session, tiny_policy_dir):
    """The decisions are scripted here (the rule itself is tested in test_scheduling.py); what is
    checked is what the pipeline does with them: a new instance with the current weights, a
    retired one, every sample still trained once."""
    import ray

    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.factory import make_task

    cfg = _cfg(tiny_policy_dir, "mode=stream-async", "generation.prompts_per_iter=4", "generation.elastic=true",
               "generation.max_instances=2", "generation.cpus_per_instance=0.5")  # trainer 1 + 2 x 0.5 CPUs
    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    script = iter([1, 0, -1])
    pipe.scaler.decide = lambda *args: next(script)
    stream = PromptStream(task.train_prompts(), seed=0)
    sent, counts, versions = [], [], []
    try:
        for it in range(4):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            samples, metrics = pipe.step(it, prompts)
            sent.extend(s.completion.request_id for s in samples)
            counts.append(metrics["gen/instances"])
            if it == 1:  # the first decision (async: once a training time is known) added one
                versions = ray.get([a.version.remote() for a in pipe.sgs.instances.values()])
                expected_version = pipe.sgs.version
        pipe.finish()
        trained = pipe.trained_ids()
    finally:
        pipe.shutdown()
    assert counts == [1.0, 2.0, 2.0, 1.0]
    assert versions == [expected_version] * 2  # the added instance installed the current weights
    assert sorted(trained) == sorted(sent) and len(set(sent)) == len(sent) == 4 * 4 * 2


def _kill_titled(title: bytes) -> int:
    """SIGKILL the one process under this one (the test's Ray) whose title starts with ``title``.

    An actor killed by an earlier test can keep its process (and title) a while on a loaded
    machine, so this waits up to a minute for such a process to go before it counts."""
    import time

    from streamrl.lab.bench.faults import _cmdline, descendants

    deadline = time.monotonic() + 60.0
    while True:
        pids = [p for p in descendants(os.getpid()) if _cmdline(p).startswith(title)]
        if len(pids) <= 1 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    return pids[0]


def _train_cfg(policy_dir, out, *extra):
    return _cfg(policy_dir, f"run.out_dir={out}", "mode=stream-async", "run.iterations=4",
                "generation.prompts_per_iter=4", "run.eval_samples=1", "cluster.num_cpus=2",
                "logging.backends=[jsonl]", *extra)


def test_a_run_whose_last_instance_is_lost_stops_after_an_exact_checkpoint(ray_session, tiny_policy_dir, tmp_path):
    import torch

    from streamrl.controller.driver import train

    def kill_after_iteration_1(it, metrics):
        if it == 1:
            _kill_titled(b"ray::GenerationInstance")

    with pytest.raises(GenerationFailed, match=r"every generation instance is gone.*checkpoint of iteration 1 saved"):
        train(_train_cfg(tiny_policy_dir, tmp_path / "run", "generation.max_restarts=0"),
              callbacks=[kill_after_iteration_1], echo=lambda *a: None)
    state = torch.load(tmp_path / "run" / "checkpoint" / "trainer.pt", weights_only=False)
    assert state["extra"]["iteration"] == 1 and state["version"] == 2
    assert len(state["extra"]["lineage"]) == 2 * 4 * 2  # iterations 0 and 1, every sample once


def test_a_run_whose_trainer_is_killed_stops_naming_the_trainer(ray_session, tiny_policy_dir, tmp_path):
    from streamrl.controller.driver import train

    def kill_trainer(it, metrics):
        if it == 1:
            _kill_titled(b"ray::IterationTrainer")

    with pytest.raises(TrainerFailed, match="trainer"):
        train(_train_cfg(tiny_policy_dir, tmp_path / "run"), callbacks=[kill_trainer], echo=lambda *a: None)


def test_an_engine_that_stops_stepping_while_its_actor_answers_is_replaced(ray_session, tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.heartbeat_timeout_s=3"))
    sgs.add_instances(2)
    requests = _requests(tiny_policy_dir, 12)
    try:
        seen, stalled, alive = generate_stalling_the_busiest(sgs, requests)
    finally:
        sgs.shutdown()
    assert_the_stalled_instance_was_replaced(sgs, requests, seen, stalled, alive)


def test_an_instance_lost_after_the_last_iteration_costs_nothing(ray_session, tiny_policy_dir, tmp_path):
    """Killed after the last iteration's step: the final evaluation runs on its replacement and
    every trained iteration is saved (this used to lose the whole run)."""
    import json

    from streamrl.controller.driver import train

    def kill_at_the_end(it, metrics):
        if it == 3:
            _kill_titled(b"ray::GenerationInstance")

    summary = train(_train_cfg(tiny_policy_dir, tmp_path / "run"), callbacks=[kill_at_the_end], echo=lambda *a: None)
    assert "eval/accuracy" in summary["after"] and summary["trained_samples_unique"] == 4 * 4 * 2
    assert (tmp_path / "run" / "checkpoint" / "trainer.pt").is_file()
    faults = [json.loads(line) for line in (tmp_path / "run" / "faults.jsonl").read_text().splitlines()] if (
        tmp_path / "run" / "faults.jsonl").is_file() else []
    # noticed at the final weight update or evaluation: one fault (written when seen, again when replaced)
    assert summary["trained_samples"] == 32 and len({f["fault"] for f in faults}) == 1


def test_more_instances_than_cpus_fails_before_ray_starts(tmp_path):
    from streamrl.config import ConfigError
    from streamrl.controller.driver import train

    cfg = load_config(None, [f"run.out_dir={tmp_path}", "mode=stream-async", "generation.num_instances=3",
                             "cluster.num_cpus=2"])
    with pytest.raises(ConfigError, match=r"generation.num_instances \(3\).*cluster.num_cpus=2"):
        train(cfg)
    assert not (tmp_path / "config.yaml").exists()  # nothing was started or written


def test_a_hung_trainer_stops_the_run_within_the_timeout(ray_session, tiny_policy_dir, tmp_path):
    from streamrl.controller.driver import train

    frozen = []

    def freeze_trainer(it, metrics):
        if it == 1:
            from streamrl.lab.bench.faults import _cmdline, descendants

            frozen.extend(p for p in descendants(os.getpid()) if _cmdline(p).startswith(b"ray::IterationTrainer"))
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)

    try:
        with pytest.raises(TrainerFailed, match=r"the trainer answered no .* within run.trainer_timeout_s=5s"):
            train(_train_cfg(tiny_policy_dir, tmp_path / "run", "run.trainer_timeout_s=5"),
                  callbacks=[freeze_trainer], echo=lambda *a: None)
    finally:
        for pid in frozen:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert len(frozen) == 1

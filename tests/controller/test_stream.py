"""Stream generation and pipelining: equivalence, staleness, exactly-once, streaming, versions."""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from streamrl.config import load_config
from streamrl.controller.common import group_samples
from streamrl.types import Group
from streamrl.trainer.actor import IterationTrainer, StalenessError
from tests.helpers import AllOnFirst, assert_moved_running_and_joined, real_samples

pytestmark = pytest.mark.slow  # every test builds the tiny policy, a Trainer, or Ray instances with engines


def _cfg(policy_dir, *overrides):
    return load_config(None, [f"policy.path={policy_dir}", "generation.max_new_tokens=24",
                              "generation.n_samples=2", "generation.prompts_per_iter=6",
                              "task.num_eval=4", "logging.backends=[console,jsonl]", *overrides])


PAIRS = [("D 23,2,10:", "21 19 17 15 13 11 =11"), ("D 23,2,10:", "21 19 =19"), ("S 4819:", "4 12 13 22 =22"),
         ("S 4819:", "4 12 =12"), ("U 5,3,10:", "8 11 =11"), ("U 5,3,10:", "8 =8"),
         ("S 12:", "1 3 =3"), ("S 12:", "1 =1")]
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]


def _params(it: IterationTrainer) -> np.ndarray:
    import torch

    return torch.cat([p.detach().flatten() for p in it.trainer.model.parameters()]).numpy()


def test_stream_sync_and_batch_sync_give_the_same_parameters(tiny_policy_dir):
    cfg = _cfg(tiny_policy_dir, "trainer.step_tokens=30", "trainer.lr=1e-2")
    batch, stream = IterationTrainer(cfg, 1, 0), IterationTrainer(cfg, 1, 0)
    groups = group_samples(real_samples(batch.trainer.model, batch.trainer.tokenizer, PAIRS, REWARDS))
    res_batch = batch.add_groups(0, [Group.of(g) for g in groups], expected=len(groups))          # disagg-batch: all at once
    results = [stream.add_groups(0, [Group.of(g)], expected=len(groups)) for g in groups]  # stream-sync: one by one
    assert results[:-1] == [None] * (len(groups) - 1) and results[-1].version == res_batch.version == 1
    assert res_batch.metrics["train/steps_in_iter"] > 1  # several dynamic batches, not one
    assert np.allclose(_params(batch), _params(stream), atol=1e-6)
    assert sorted(batch.drain_trained_ids()) == sorted(stream.drain_trained_ids())


def _sample_with_version(sample, version):
    from dataclasses import replace

    return replace(sample, completion=replace(sample.completion, version_start=version, version_end=version))


@settings(max_examples=30, deadline=None)
@given(bound=st.integers(0, 2), versions=st.lists(st.integers(0, 6), min_size=1, max_size=12), trainer_v=st.integers(0, 6))
def test_trainer_never_accepts_a_sample_beyond_the_staleness_bound(tiny_policy_dir, bound, versions, trainer_v):
    cfg = _cfg(tiny_policy_dir)
    tr = _cached_trainer(tiny_policy_dir, bound)
    tr.trainer.version = trainer_v
    base = group_samples(real_samples(tr.trainer.model, tr.trainer.tokenizer, PAIRS[:2], REWARDS[:2]))[0]
    for i, v in enumerate(versions):
        tr._reset(-1, 0)
        group = [_sample_with_version(s, v) for s in base]
        if trainer_v - v > bound:
            with pytest.raises(StalenessError, match=f"bound {bound}"):
                tr.add_groups(i, [Group.of(group)], expected=2)
        else:
            assert tr.add_groups(i, [Group.of(group)], expected=2) is None  # accepted, waits for the 2nd group
    del cfg


_TRAINERS: dict = {}


def _cached_trainer(policy_dir, bound):
    if (policy_dir, bound) not in _TRAINERS:
        _TRAINERS[(policy_dir, bound)] = IterationTrainer(_cfg(policy_dir), 1, bound)
    return _TRAINERS[(policy_dir, bound)]


def _requests(policy_dir, n_prompts, tag="t"):
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.synthetic import SyntheticTask

    _, tok = load_policy(policy_dir)
    cfg = _cfg(policy_dir)
    prompts = SyntheticTask(num_train=n_prompts, num_eval=1, seed=1).train_prompts()
    return RequestBuilder(tok, cfg).build(prompts, iteration=0, tag=tag)


def test_every_request_is_returned_exactly_once_when_an_instance_is_removed(ray_session, tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    # batch 2: an instance cannot finish its whole share before the driver's first poll returns
    sgs = StreamGenerationService(_cfg(tiny_policy_dir, "generation.num_instances=2",
                                       "generation.max_requests_per_batch=2"))
    sgs.add_instances(2)
    requests = _requests(tiny_policy_dir, 12)
    seen, removed = [], 0
    try:
        for c in sgs.generate(requests):
            seen.append(c.request_id)
            if not removed:
                left = sgs.ledger.counts(sgs.instances)
                victim = max(left, key=left.get)  # the instance with the most unfinished requests
                removed = sgs.remove_instance(victim) + 1  # re-submits the victim's unfinished requests
    finally:
        sgs.shutdown()
    assert sorted(seen) == sorted(r.request_id for r in requests)  # none lost, none twice
    assert removed > 1  # the removed instance really had unfinished work that moved
    assert sgs.counters["sgs/resubmitted"] == removed - 1


def _run(cfg):
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.controller.common import PromptStream
    from streamrl.tasks.factory import make_task
    from streamrl.models.tiny import load_policy

    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=0)
    sent, per_iter = [], []
    try:
        for it in range(cfg.run.iterations):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            samples, metrics = pipe.step(it, prompts)
            per_iter.append((it, samples, metrics))
            sent.extend(s.completion.request_id for s in samples)
        pipe.finish()
        trained = pipe.trained_ids()
        events = pipe.timeline.events()
        late = pipe.unreported_train_metrics()
    finally:
        pipe.shutdown()
    return sent, trained, per_iter, events, late


@pytest.mark.parametrize("mode", ["stream-sync", "stream-async"])
def test_pipeline_trains_every_sample_once_and_respects_versions(ray_session, tiny_policy_dir, mode):
    cfg = _cfg(tiny_policy_dir, f"mode={mode}", "run.iterations=3", "trainer.step_tokens=60",
               "generation.num_instances=1")
    sent, trained, per_iter, events, late = _run(cfg)
    assert sorted(sent) == sorted(trained) and len(set(trained)) == len(trained)
    # every training step's metrics come out exactly once: with its own step (sync), or with a
    # later step or after the run, named by train/iteration (async)
    if mode == "stream-sync":
        assert all("time/train_s" in m for _, _, m in per_iter) and late == []
    else:
        reported = [m["train/iteration"] for _, _, m in per_iter if "train/iteration" in m] + [it for it, _ in late]
        assert sorted(reported) == [0, 1, 2]
        assert all("time/train_s" in m for it, m in late)
    for it, samples, _ in per_iter:
        versions = {s.completion.version_start for s in samples}
        if mode == "stream-sync":
            assert versions == {it}  # every sample of iteration i comes from W_i
        else:
            assert min(versions) >= it - 1 and max(versions) <= it  # one step stale at most
    if mode == "stream-async":
        # generation of iteration i+1 overlapped training of iteration i at least once
        assert any(s.completion.version_start == it - 1 for it, samples, _ in per_iter[1:] for s in samples)
    # streaming: the trainer had started on a sample before the iteration's last one was generated
    first = per_iter[0]
    last_gen_end = max(s.completion.t_end for s in first[1])
    first_prepare = min(e.start for e in events if e.what == "prepare" and e.iteration == 0)
    assert first_prepare < last_gen_end


def _drain(sgs, ids):
    """Poll until every id in ``ids`` came back; returns the completions in arrival order."""
    wanted, out = set(ids), []
    while wanted:
        for c in sgs.poll():
            wanted.discard(c.request_id)
            out.append(c)
    return out


def test_rebalancing_moves_queued_work_to_a_new_instance_and_loses_and_duplicates_nothing(ray_session, tiny_policy_dir):
    from streamrl.sgs.service import StreamGenerationService

    cfg = _cfg(tiny_policy_dir, "generation.rebalance=true", "generation.rebalance_threshold=0.1",
               "generation.max_requests_per_batch=2", "ranker.name=none")
    sgs = StreamGenerationService(cfg)
    sgs.add_instance()
    requests = _requests(tiny_policy_dir, 10, tag="rb")  # 20 requests; gen-0 runs 2 and holds most back
    try:
        sgs.submit(requests)
        held_before = ray_session.get(sgs.instances["gen-0"].held_ids.remote())
        assert len(held_before) >= 10  # not handed to the engine: not started
        sgs.add_instance()  # an idle instance joins: the next poll moves queued work to it
        done = _drain(sgs, [r.request_id for r in requests])
        pending = ray_session.get([a.num_pending.remote() for a in sgs.instances.values()])
    finally:
        sgs.shutdown()
    ids = [c.request_id for c in done]
    assert sorted(ids) == sorted(r.request_id for r in requests) and len(set(ids)) == len(ids)  # exactly once
    assert sgs.counters["sgs/rebalanced"] > 0 and sgs.counters["sgs/duplicates"] == 0
    moved_and_run = {c.request_id for c in done if c.instance == "gen-1"}
    assert moved_and_run and moved_and_run <= set(held_before)  # only not-yet-started requests moved
    assert pending == [0, 0] and not sgs.pending()


def _two_instances_eos_off(policy_dir, n_prompts, seed, tag, *overrides):
    """A rebalancing SGS with two instances and EOS unreachable (every request runs to
    max_new_tokens), and one request per synthetic prompt of a small task."""
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.tasks.synthetic import SyntheticTask

    cfg = _cfg(policy_dir, "generation.rebalance=true", "generation.n_samples=1", "generation.rebalance_interval_s=0.05",
               "ranker.name=none", *overrides)
    requests = _requests_for(policy_dir, cfg, SyntheticTask(num_train=n_prompts, num_eval=1, seed=seed).train_prompts(), tag)
    sgs = StreamGenerationService(cfg, engine_overrides={"eos_token_id": None})
    sgs.add_instances(2)
    return sgs, requests


def test_rebalancing_moves_running_requests_with_their_prefix_and_joins_them(ray_session, tiny_policy_dir):
    """Four requests run on gen-0 (its whole batch) while gen-1 idles. Rebalancing stops some of
    them mid-generation and resumes them on gen-1 from their prefix. Each comes back exactly
    once, whole: the prompt as submitted, every token (EOS off: exactly max_new_tokens) with its
    log-prob."""
    sgs, requests = _two_instances_eos_off(tiny_policy_dir, 4, 2, "mv", "generation.rebalance_threshold=0.1",
                                           "generation.max_requests_per_batch=4", "generation.max_new_tokens=160")
    sgs.dispatch = AllOnFirst()
    try:
        sgs.submit(requests)
        assert set(sgs.ledger.where().values()) == {"gen-0"}
        done = _drain(sgs, [r.request_id for r in requests])
        pending = ray_session.get([a.num_pending.remote() for a in sgs.instances.values()])
    finally:
        sgs.shutdown()
    assert_moved_running_and_joined(sgs, requests, done, 160)
    assert pending == [0, 0] and not sgs.pending() and not sgs.ledger.moved()


class _CallLog:
    """Stands in for an instance's actor handle (``sgs.pool[name].actor``): records the name of each
    method the service calls on the instance, and calls the real actor."""

    def __init__(self, actor, calls: list[str]):
        self.actor, self.calls = actor, calls

    def __getattr__(self, method: str):
        self.calls.append(method)
        return getattr(self.actor, method)


def _every_instance_full(sgs, batch: int) -> bool:
    from collections import Counter

    unfinished = Counter(sgs.ledger.where().values())
    return all(unfinished[name] >= batch for name in sgs.instances)


def test_rebalancing_reads_no_progress_while_every_instance_has_a_full_batch(ray_session, tiny_policy_dir):
    """Progress is only read when a check could act (some instance with free slots); while both
    instances run a full batch with more queued, polls are plain and nothing is moved. Checked on
    every poll that starts with both instances full, however soon requests finish."""
    sgs, requests = _two_instances_eos_off(tiny_policy_dir, 8, 3, "fp", "generation.max_requests_per_batch=2",
                                           "generation.max_new_tokens=400", "generation.dispatch=round-robin")
    actors, calls = dict(sgs.instances), []
    for name, actor in actors.items():
        sgs.pool[name].actor = _CallLog(actor, calls)
    wanted, done, full_polls = {r.request_id for r in requests}, [], 0
    try:
        sgs.submit(requests)  # 4 per instance, 2 running each: every instance is full
        while wanted:
            full, rounds = _every_instance_full(sgs, 2), sgs.counters["sgs/rebalance_rounds"]
            calls.clear()
            for c in sgs.poll(timeout=0.1):
                wanted.discard(c.request_id)
                done.append(c)
            if full:
                full_polls += 1
                assert "poll_with_progress" not in calls, calls  # plain polls only
                if _every_instance_full(sgs, 2):  # still full after it: no check ran, nothing was asked
                    assert set(calls) <= {"poll"} and sgs.counters["sgs/rebalance_rounds"] == rounds, calls
    finally:
        for name, actor in actors.items():
            sgs.pool[name].actor = actor
        sgs.shutdown()
    assert full_polls >= 1  # the first poll starts with every instance full
    assert sorted(c.request_id for c in done) == sorted(r.request_id for r in requests)


def test_skewness_aware_sgs_dispatches_and_orders_by_ranker_predictions(ray_session, tiny_policy_dir):
    from streamrl.tasks.factory import make_task
    from streamrl.sgs.service import StreamGenerationService

    cfg = _cfg(tiny_policy_dir, "generation.dispatch=skewness-aware", "generation.order=lpt",
               "ranker.name=history", "generation.max_requests_per_batch=2")
    prompts = make_task(cfg).train_prompts()[:8]
    sgs = StreamGenerationService(cfg)
    sgs.attach_prompts(prompts)
    sgs.add_instances(2)
    try:
        first = list(sgs.generate(_requests_for(tiny_policy_dir, cfg, prompts, "a")))
        cold = sgs.take_metrics()
        assert set(cold) >= {"rank/recall@20%", "rank/recall@10%", "rank/recall@5%", "rank/spearman"}
        # per prompt too: before the first fit every group is predicted alike, so recall is k / n groups
        assert cold["rank/group/recall@20%"] == pytest.approx(2 / 8) and cold["rank/group/recall@5%"] == pytest.approx(1 / 8)
        assert sgs.ranker.wait(timeout=60)  # the refresh ran in the background after the batch
        second = _requests_for(tiny_policy_dir, cfg, prompts, "b")
        sgs.submit(second)
        pred = {r.request_id: sgs.ledger.predicted(r.request_id) for r in second}
        where = sgs.ledger.where()
        prio = {rid: sgs.ledger.record(rid).sent.priority for rid in where}
        _drain(sgs, list(pred))
    finally:
        sgs.shutdown()
    mean_len = {}
    for c in first:
        mean_len.setdefault(c.prompt_id, []).append(len(c.output_ids))
    for r in second:  # the history ranker predicts each prompt's mean length from the first batch (log space)
        lens = np.array(mean_len[r.prompt_id], dtype=float)
        assert pred[r.request_id] == pytest.approx(np.expm1(np.log1p(lens).mean()))
    assert prio == pred  # LPT: the engine admits by predicted length
    split = sgs.dispatch.last_split
    longest = sorted(pred, key=lambda rid: -pred[rid])[: split.long_requests]
    if split.long_instances:
        assert all(where[rid] == "gen-0" for rid in longest)  # Algorithm 2's long-tail pool
        assert all(where[rid] == "gen-1" for rid in pred if rid not in longest)


def _requests_for(policy_dir, cfg, prompts, tag):
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy

    _, tok = load_policy(policy_dir)
    return RequestBuilder(tok, cfg).build(prompts, iteration=0, tag=tag)


def test_stream_async_checkpoint_without_drain_holds_exactly_the_iterations_before_it(ray_session, tiny_policy_dir,
                                                                                       tmp_path):
    """The checkpoint is sent right after iteration 1's step returns, while the trainer may still
    train iteration 1 and before iteration 2 is generated; it must hold iterations 0-1, not 2."""
    import torch

    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext, make_pipeline
    from streamrl.models.tiny import load_policy
    from streamrl.tasks.factory import make_task

    cfg = _cfg(tiny_policy_dir, "mode=stream-async", "generation.num_instances=1")
    task = make_task(cfg)
    _, tok = load_policy(cfg.policy.path)
    ctx = RunContext(cfg, task, tok)
    pipe = make_pipeline(cfg, ctx)
    stream = PromptStream(task.train_prompts(), seed=0)
    ids: dict[int, list[str]] = {}
    try:
        for it in range(3):
            prompts = stream.next_batch(cfg.generation.prompts_per_iter)
            ctx.scorer.register(prompts)
            samples, _ = pipe.step(it, prompts)
            ids[it] = [s.completion.request_id for s in samples]
            if it == 1:
                pipe.checkpoint(str(tmp_path / "ckpt"), {"iteration": 1, "stream": stream.state()})
        pipe.finish()
        events = pipe.timeline.events()
    finally:
        pipe.shutdown()
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    assert state["version"] == 2 and state["extra"]["iteration"] == 1
    assert sorted(state["extra"]["lineage"]) == sorted(ids[0] + ids[1])
    assert [e.version for e in events if e.what == "checkpoint"] == [2]

"""The reweighted history ranker: importance weights to the installed policy, and its live plumbing."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from streamrl.ranker.base import make_ranker
from streamrl.ranker.reweighted import Trace

SHORT, LONG = "97 98 99 100 =100", "97 98 99 100 101 102 103 104 105 106 107 108 =108"


def _ranker(policy_dir, **kw):
    """The ranker without a prior; the importance-weighted ``sequence`` estimator unless ``kw`` names one."""
    return make_ranker("reweighted", policy_path=policy_dir, **{"prior": None, "estimator": "sequence", **kw})


def _ids(ranker, text, response):
    tok = ranker.tokenizer
    return [tok.bos_token_id] + tok.encode(text, add_special_tokens=False), \
        tok.encode(response, add_special_tokens=False) + [tok.eos_token_id]


def _perturbed(model, seed=1, scale=0.3):
    """The policy's state dict with seeded noise on every weight: another policy of the same shape."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * v.std().nan_to_num(0.0) * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
            for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_estimate_is_self_normalised_importance_sampling_worked_by_hand(tiny_policy_dir):
    for beta, w_short in ((1.0, 3.0), (0.5, math.sqrt(3.0)), (0.0, 1.0)):
        ranker = _ranker(tiny_policy_dir, beta=beta)
        p, short = _ids(ranker, "U 96,1:", SHORT)
        _, long_ = _ids(ranker, "U 96,1:", LONG)
        lp_short, lp_long = ranker.response_logprobs(ranker.model, [p, p], [short, long_])
        # The short response is 3x likelier now than when it was sampled; the long one unchanged.
        traces = [Trace(tuple(short), lp_short - math.log(3.0)), Trace(tuple(long_), lp_long)]
        ranker.fit(["U 96,1:"] * 2, [len(short), len(long_)], ["k", "k"], traces=traces)
        expected = (w_short * len(short) + len(long_)) / (w_short + 1.0)
        assert ranker.score(["U 96,1:"], ["k"])[0] == pytest.approx(expected, rel=1e-6), beta


@pytest.mark.slow
def test_per_decision_estimate_weighs_each_survival_step_by_its_prefix_worked_by_hand(tiny_policy_dir):
    """Two responses of 5 and 12 tokens; the current policy likes the long one's last token 3x
    more than the behaviour policy did, every other token equally. One weight per response:
    (5 + 3 * 12) / 4. Per decision: both alive for t < 5 (S = 1); for 5 <= t < 11 the long one's
    prefix ratio is still 1 (S = 1/2); its whole ratio 3 decides only t = 11 (S = 3/4)."""
    from streamrl.ranker.reweighted import _per_decision

    ranker = _ranker(tiny_policy_dir, beta=1.0, estimator="per_decision")
    p, short = _ids(ranker, "U 96,1:", SHORT[-5:-1])
    _, long_ = _ids(ranker, "U 96,1:", "97 98 99 10")
    assert (len(short), len(long_)) == (5, 12)
    now_short, now_long = ranker.response_token_logprobs(ranker.model, [p, p], [short, long_])
    behaviour_long = now_long.copy()
    behaviour_long[-1] -= math.log(3.0)
    traces = [Trace(tuple(short), float(now_short.sum()), tuple(now_short)),
              Trace(tuple(long_), float(behaviour_long.sum()), tuple(behaviour_long))]
    ranker.fit(["U 96,1:"] * 2, [5, 12], ["k", "k"], traces=traces)
    assert ranker.score(["U 96,1:"], ["k"])[0] == pytest.approx(5 + 6 * 0.5 + 0.75, rel=1e-6)
    sequence = _ranker(tiny_policy_dir, beta=1.0).fit(["U 96,1:"] * 2, [5, 12], ["k", "k"], traces=traces)
    assert sequence.score(["U 96,1:"], ["k"])[0] == pytest.approx((5 + 3 * 12) / 4, rel=1e-6)
    # equal ratios: the plain mean; a trace with only its sum: its whole ratio at its last token
    assert _per_decision([np.zeros(3), np.zeros(7), np.zeros(0)], np.array([3.0, 7.0, 2.0])) == pytest.approx(4.0)
    assert _per_decision([np.array([0.0, 0.0, math.log(3.0)]), np.zeros(0)], np.array([3.0, 1.0])) == pytest.approx(
        1 + 0.5 + 0.75)


def test_hazard_estimate_is_a_weighted_product_limit_curve_worked_by_hand():
    """Lengths 3 and 7 (ratio 1 throughout) and 2 (its second token 3x likelier now). At length 2
    all three run, the 2-token one stops with weight 3 of 5: h(2) = 3/5. At 3 the other two run
    and one stops: h(3) = 1/2. So P(L > t) = 1, 1, 2/5, 1/5 x 4, and E[L] = 1 + 1 + 0.4 + 0.8."""
    from streamrl.ranker.reweighted import _hazard

    cum = [np.zeros(3), np.zeros(7), np.array([0.0, math.log(3.0)])]
    assert _hazard(cum, np.array([3.0, 7.0, 2.0])) == pytest.approx(1 + 1 + 0.4 + 0.8)
    assert _hazard([np.zeros(3), np.zeros(7), np.zeros(0)], np.array([3.0, 7.0, 2.0])) == pytest.approx(4.0)


def test_tree_estimate_uses_the_current_policys_probabilities_along_the_remembered_paths_worked_by_hand():
    """Two remembered responses, ``a EOS`` (2 tokens) and ``b x EOS`` (3). The current policy takes
    a / b first with 0.5 / 0.3, so 0.2 leaves the tree at the root, where the mean of the
    responses through it is 2.5; after ``a`` it ends with 0.7, and the 0.3 that leaves there is
    valued at that response's length, 2; ``b x`` is 3 whatever it does. So E[L] = 0.5 * 2 + 0.3 * 3
    + 0.2 * 2.5. A response sampled twice is one path: its probability is the policy's, not a count."""
    from streamrl.ranker.reweighted import _tree

    lg = math.log
    a, bx = ((1, 0), np.array([lg(0.5), lg(0.7)]), 2.0), ((2, 5, 0), np.array([lg(0.3), lg(0.9), lg(0.6)]), 3.0)
    assert _tree([a, bx]) == pytest.approx(0.5 * 2 + 0.3 * 3 + 0.2 * 2.5)
    assert _tree([a, a, bx]) == pytest.approx(0.5 * 2 + 0.3 * 3 + 0.2 * (2 + 2 + 3) / 3)
    # the policy now (almost) always takes the long path: the estimate follows it, not the 1:1 count
    sure = ((2, 5, 0), np.array([lg(0.999), 0.0, 0.0]), 3.0)
    assert _tree([((1, 0), np.array([lg(0.001), 0.0]), 2.0), sure]) == pytest.approx(0.001 * 2 + 0.999 * 3)
    # a response cut at the cap is worth its length; one the policy leaves early is worth the lengths past there
    capped = ((7, 7, 7), np.array([0.0, lg(0.5), 0.0]), 3.0)
    assert _tree([capped]) == pytest.approx(3.0)
    # a reasoning-length response (far deeper than Python's recursion limit)
    assert _tree([((5,) * 20000, np.zeros(20000), 20000.0)]) == pytest.approx(20000.0)


@pytest.mark.slow
def test_tree_estimator_scores_with_the_installed_policy(tiny_policy_dir):
    """The ranker's ``tree`` score is ``_tree`` over the installed policy's teacher-forced log-probs.
    The responses are the policy's greedy path and that path cut short by EOS. The test policy is
    far from sure of either, so most of its mass leaves the tree and the estimate is near their
    mean; the same policy with its logits scaled 20x follows the greedy path more closely, and the
    estimate moves towards that path's length."""
    from streamrl.ranker.reweighted import _tree

    ranker = _ranker(tiny_policy_dir, estimator="tree")
    p, _ = _ids(ranker, "U 96,1:", "")
    greedy = []
    with torch.no_grad():
        for _ in range(6):
            greedy.append(int(ranker.model(input_ids=torch.tensor([p + greedy])).logits[0, -1].argmax()))
    long_, short = greedy + [ranker.tokenizer.eos_token_id], greedy[:3] + [ranker.tokenizer.eos_token_id]
    # behaviour log-probs are not used; the short response was sampled twice
    traces = [Trace(tuple(short), 0.0), Trace(tuple(long_), 0.0), Trace(tuple(short), 0.0)]
    ranker.fit(["U 96,1:"] * 3, [len(short), len(long_), len(short)], ["k"] * 3, traces=traces)
    sharp = {k: 20.0 * v if k == "model.norm.weight" else v for k, v in ranker.model.state_dict().items()}
    scores = []
    for policy in (None, sharp):
        if policy is not None:
            ranker.set_policy(policy, 1)
        lp = ranker.response_token_logprobs(ranker.model, [p, p], [short, long_])
        scores.append(ranker.score(["U 96,1:"], ["k"])[0])
        paths = [(short, lp[0], len(short)), (long_, lp[1], len(long_)), (short, lp[0], len(short))]
        assert scores[-1] == pytest.approx(_tree(paths), rel=1e-6)
    assert ranker.counters["forward_responses"] == 2 * 2  # one pass per distinct response, per policy
    assert scores[0] == pytest.approx((2 * len(short) + len(long_)) / 3, abs=0.5)
    assert scores[1] > scores[0] + 0.25, scores


@pytest.mark.slow
def test_token_logprobs_must_match_the_response_token_for_token(tiny_policy_dir):
    with pytest.raises(ValueError, match="2 token log-probs for 3 tokens"):
        Trace((1, 2, 3), -1.0, (-0.5, -0.5))
    ranker = _ranker(tiny_policy_dir, estimator="per_decision")
    trace = ranker.trace_of("97 =97", "stop", -2.0, [-0.25] * 7)  # 6 characters and EOS
    assert len(trace.output_ids) == 7 and trace.token_logprobs == (-0.25,) * 7
    # logged ids win over the text (which can lose a special token sampled mid-response)
    pad = ranker.tokenizer.pad_token_id
    ids = (*trace.output_ids[:3], pad, *trace.output_ids[3:])
    assert ranker.trace_of("97 =97", "stop", -2.0, [-0.25] * 8, ids).output_ids == ids
    # text only, and it does not line up with the per-token log-probs: only the sum is kept, counted
    misaligned = ranker.trace_of("97 =97", "stop", -2.0, [-0.25] * 8)
    assert misaligned.token_logprobs is None and misaligned.logprob == -2.0
    assert ranker.counters["misaligned_traces"] == 1
    with pytest.raises(ValueError, match="estimator"):
        _ranker(tiny_policy_dir, estimator="doubly_robust")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.slow
def test_response_logprobs_equal_the_engines_sampled_logprobs(tiny_policy_dir, temperature):
    from streamrl.models.tiny import encode_prompt, load_policy
    from streamrl.sgs.engines.base import make_engine
    from streamrl.types import GenRequest

    model, tok = load_policy(tiny_policy_dir)
    engine = make_engine("transformers", model, temperature=temperature, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, num_blocks=128, page_size=32, max_batch_tokens=256,
                         max_requests_per_batch=4, seed=0)
    texts = ["U 96,1:", "D 412,2:", "U 150,3:", "D 207,1:"]
    try:
        for i, t in enumerate(texts):
            engine.add_request(GenRequest(f"r{i}", f"p{i}", 0, tuple(encode_prompt(tok, t)), 60))
        done = []
        while len(done) < len(texts):
            got = engine.get_completions(timeout=60)
            assert got, "no completion within 60 s"
            done += got
    finally:
        engine.shutdown()
    ranker = _ranker(tiny_policy_dir, temperature=temperature)
    lp = ranker.response_logprobs(ranker.model, [c.prompt_ids for c in done], [c.output_ids for c in done])
    np.testing.assert_allclose(lp, [sum(c.logprobs) for c in done], atol=1e-3)


def _flipping_history(ranker, other):
    """Histories of two prompts such that "a" ranks above "b" under the ranker's policy X and below
    it under ``other`` (a state dict, policy Y), or the other way round (``first_above``); beta = 1.

    "a" remembers a short and a long response. With d = log pi(long) - log pi(short) under each
    policy, behaviour log-probs whose difference is (d_X + d_Y) / 2 give the long response the
    log-weight (d_X - d_Y) / 2 relative to the short one under X and the opposite under Y. "b"
    remembers two responses without traces, both at the midpoint length."""
    from streamrl.models.tiny import load_policy

    model_y, _ = load_policy(ranker.model_path)
    model_y.load_state_dict(other)
    p, short = _ids(ranker, "U 96,1:", SHORT)
    _, long_ = _ids(ranker, "U 96,1:", LONG)
    lx = ranker.response_logprobs(ranker.model, [p, p], [short, long_])
    ly = ranker.response_logprobs(model_y.eval(), [p, p], [short, long_])
    dx, dy = lx[1] - lx[0], ly[1] - ly[0]
    assert abs(dx - dy) > 0.5, "the perturbation must change the policy's preference"
    traces = [Trace(tuple(short), lx[0]), Trace(tuple(long_), lx[0] + (dx + dy) / 2), None, None]
    mid = (len(short) + len(long_)) / 2
    return (["U 96,1:", "U 96,1:", "D 412,2:", "D 412,2:"], [len(short), len(long_), mid, mid],
            ["a", "a", "b", "b"], traces, dx > dy)


@pytest.mark.slow
def test_installing_a_new_policy_changes_the_ranking_and_invalidates_the_cache(tiny_policy_dir):
    ranker = _ranker(tiny_policy_dir, beta=1.0)
    other = _perturbed(ranker.model)
    texts, lengths, keys, traces, first_above = _flipping_history(ranker, other)
    ranker.fit(texts, lengths, keys, traces=traces)
    before = ranker.score(["U 96,1:", "D 412,2:"], ["a", "b"])
    assert (before[0] > before[1]) == first_above
    again = ranker.score(["U 96,1:"], ["a"])
    assert ranker.counters["cache_hits"] == 1 and again[0] == before[0]
    ranker.set_policy(other, version=7)
    after = ranker.score(["U 96,1:", "D 412,2:"], ["a", "b"])
    assert ranker.version == 7
    assert (after[0] > after[1]) != first_above  # the order flipped with the policy
    assert after[1] == before[1]  # "b" has no traces: its plain mean does not depend on the policy


@pytest.mark.slow
def test_prompts_without_history_get_the_prior_or_the_median(tiny_policy_dir):
    ranker = _ranker(tiny_policy_dir)
    ranker.fit(["U 96,1:", "U 96,1:", "D 412,2:"], [10, 30, 50], ["a", "a", "b"])
    assert ranker.score(["U 150,3:"], ["new"])[0] == pytest.approx(30.0)  # median of the recent lengths
    assert ranker.score(["U 96,1:"], ["a"])[0] == pytest.approx(20.0)  # no traces: the plain mean
    with_prior = make_ranker("reweighted", policy_path=tiny_policy_dir, prior="learned")
    texts = [f"U {100 + i},{1 + i % 3}:" for i in range(40)]
    with_prior.fit(texts, [5.0 + i for i in range(40)], [f"k{i}" for i in range(40)])
    unseen = ["U 300,1:", "D 512,3:"]
    np.testing.assert_allclose(with_prior.score(unseen, ["n1", "n2"]), with_prior.prior.score(unseen, ["n1", "n2"]))


@pytest.mark.slow
def test_reweighted_ranker_names_bad_settings(tiny_policy_dir):
    with pytest.raises(ValueError, match="beta"):
        _ranker(tiny_policy_dir, beta=1.5)
    with pytest.raises(ValueError, match="max_samples"):
        _ranker(tiny_policy_dir, max_samples=0)
    with pytest.raises(ValueError, match="model_path"):
        make_ranker("reweighted")
    assert make_ranker("reweighted", policy_path=tiny_policy_dir, prior=None).estimator == "tree"  # the default
    with pytest.raises(ValueError, match="traces"):
        _ranker(tiny_policy_dir).fit(["U 96,1:"], [3.0], ["a"], traces=[])
    with pytest.raises(RuntimeError, match="before fit"):
        _ranker(tiny_policy_dir).score(["U 96,1:"])


@pytest.mark.slow
def test_online_ranker_installs_policies_and_scores_the_next_batch_ahead(tiny_policy_dir):
    from streamrl.ranker.online import OnlineRanker

    ranker = _ranker(tiny_policy_dir, beta=1.0)
    other = _perturbed(ranker.model)
    texts, lengths, keys, traces, first_above = _flipping_history(ranker, other)
    online = OnlineRanker(ranker)
    online.register(["a", "b"], ["U 96,1:", "D 412,2:"])
    online.observe(keys, lengths, traces)
    online.prefetch(["a", "b"])
    assert online.wait(timeout=60)
    first = online.predict(["a", "b"])
    assert (first[0] > first[1]) == first_above
    online.set_policy(lambda: other, version=3)
    online.prefetch(["a", "b"])  # queued after the policy: scored under version 3
    assert online.wait(timeout=60)
    second = online.predict(["a", "b"])
    assert (second[0] > second[1]) != first_above
    m = online.metrics()
    assert m["rank/policy_version"] == 3 and m["rank/prefetched"] == 4 and m["rank/scored_on_demand"] == 0
    # new history for a prompt of the prefetched batch: scored again at once, in the thread
    online.observe(["a"], [5.0], [None])
    assert online.wait(timeout=60)
    third = online.predict(["a", "b"])
    assert online.metrics()["rank/scored_on_demand"] == 0 and online.metrics()["rank/rescored_ahead"] == 1
    assert third[0] != second[0] and third[1] == second[1]
    # for a prompt outside it, new history drops it from the table until it is asked for
    online.prefetch(["b"])
    online.observe(["a"], [7.0], [None])
    assert online.wait(timeout=60)
    online.predict(["a", "b"])
    assert online.metrics()["rank/scored_on_demand"] == 1 and online.metrics()["rank/rescored_ahead"] == 1
    online.close()


def test_checkpoint_resolver_picks_the_newest_kept_version_the_lag_allows(tmp_path):
    from streamrl.lab.rank_eval import checkpoint_resolver

    for k in (4, 8, 12):
        (tmp_path / f"iter-{k}").mkdir()
        (tmp_path / f"iter-{k}" / "config.json").write_text("{}")
    (tmp_path / "iter-16").mkdir()  # no config.json: not a checkpoint
    at = checkpoint_resolver(tmp_path, lag=1)
    assert at(4) is None and at(5) == (str(tmp_path / "iter-4"), 4) and at(13) == (str(tmp_path / "iter-12"), 12)
    assert checkpoint_resolver(tmp_path, lag=0)(8) == (str(tmp_path / "iter-8"), 8)
    with pytest.raises(FileNotFoundError, match="keep_checkpoints"):
        checkpoint_resolver(tmp_path / "none")


@pytest.mark.slow
def test_streaming_eval_installs_each_steps_checkpoint_and_reads_logged_responses(tmp_path, tiny_policy_dir):
    """A rollout log with responses and log-probs: the streaming protocol hands the ranker traces
    and the checkpoint of each step's generating version (less the lag)."""
    from streamrl.lab.rank_eval import checkpoint_resolver, streaming
    from streamrl.ranker.records import load_samples_jsonl

    ranker = _ranker(tiny_policy_dir)
    p, short = _ids(ranker, "U 96,1:", SHORT)
    lp = float(ranker.response_logprobs(ranker.model, [p], [short])[0])
    rows = [{"key": k, "text": t, "length": len(short), "iteration": it, "version_start": it, "response": SHORT,
             "finish_reason": "stop", "logprob": lp} for it in range(3) for k, t in (("a", "U 96,1:"), ("b", "D 412,2:"))]
    (tmp_path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ckpts = tmp_path / "checkpoints"
    (ckpts / "iter-1").mkdir(parents=True)
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "generation_config.json"):
        src = f"{tiny_policy_dir}/{f}"
        try:
            (ckpts / "iter-1" / f).write_bytes(open(src, "rb").read())
        except FileNotFoundError:
            pass
    recs = load_samples_jsonl(tmp_path / "samples.jsonl", "iteration")
    assert recs[0].response == SHORT and recs[0].logprob == pytest.approx(lp) and recs[0].version == 0
    installed = []

    def factory():
        r = _ranker(tiny_policy_dir)
        real = r.set_policy
        r.set_policy = lambda w, v: (installed.append(v), real(w, v))
        return r

    preds = streaming(recs, factory, warmup_steps=1, policy_at=checkpoint_resolver(ckpts, lag=1))
    assert installed == [1]  # step 1 (version 1 - lag 1 = 0): none kept; step 2: iter-1
    assert [len(p.records) for p in preds] == [2, 2]


@pytest.mark.slow
def test_the_sgs_feeds_the_ranker_responses_and_policies_and_dispatches_on_the_reweighted_estimate(
        ray_session, tiny_policy_dir):
    """Batch "a" is generated by version 0; version 1 (other weights) is installed; the next batch's
    prompts are scored ahead; batch "b" is dispatched on each prompt's batch-"a" lengths weighted
    by pi_1 / pi_0 of its responses, without scoring anything on the critical path."""
    from streamrl.config import load_config
    from streamrl.controller.common import RequestBuilder
    from streamrl.tasks.factory import make_task
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.weights.flat import flatten
    from streamrl.weights.transfer import RayObjectStoreTransport

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "generation.max_new_tokens=30", "generation.n_samples=3",
                             "task.num_eval=4", "logging.backends=[console,jsonl]", "generation.dispatch=skewness-aware",
                             "ranker.name=reweighted", "ranker.kwargs={prior: null, beta: 1.0, estimator: sequence}"])
    prompts = make_task(cfg).train_prompts()[:6]
    model, tok = load_policy(tiny_policy_dir)
    builder = RequestBuilder(tok, cfg)
    other = _perturbed(model)
    sgs = StreamGenerationService(cfg)
    sgs.attach_prompts(prompts)
    sgs.add_instance()
    try:
        batch_a = builder.build(prompts, iteration=0, tag="a")
        prompt_of = {r.request_id: r.prompt_id for r in batch_a}
        first = list(sgs.generate(batch_a))
        assert sgs.ranker.wait(timeout=120)
        sgs.update(RayObjectStoreTransport().publish(flatten(other, 1)), 1)
        sgs.prefetch(prompts)
        assert sgs.ranker.wait(timeout=120)
        second = builder.build(prompts, iteration=1, tag="b")
        sgs.submit(second)
        pred = {r.prompt_id: sgs.ledger.predicted(r.request_id) for r in second}
        metrics = sgs.ranker.metrics()
    finally:
        sgs.shutdown()
    assert metrics["rank/policy_version"] == 1 and metrics["rank/scored_on_demand"] == 0
    assert metrics["rank/prefetched"] == len(prompts)
    model.load_state_dict(other)
    ranker = sgs.ranker.ranker
    now = ranker.response_logprobs(model.eval(), [c.prompt_ids for c in first], [c.output_ids for c in first])
    by_prompt: dict[str, list[tuple[float, float]]] = {}
    for c, lp in zip(first, now):
        by_prompt.setdefault(prompt_of[c.request_id], []).append((lp - sum(c.logprobs), len(c.output_ids)))
    for key, rows in by_prompt.items():
        d = np.array([r[0] for r in rows])
        w = np.exp(d - d.max())
        assert pred[key] == pytest.approx(float(np.dot(w, [r[1] for r in rows]) / w.sum()), rel=1e-5)


def test_rank_eval_offers_every_estimator_the_ranker_has(capsys):
    import re

    from streamrl.cli import build_parser
    from streamrl.ranker.reweighted import ESTIMATORS

    def parse(estimator):
        return build_parser().parse_args(["rank", "eval", "--data", "samples", "--estimator", estimator])

    assert [parse(e).estimator for e in ESTIMATORS] == list(ESTIMATORS)
    with pytest.raises(SystemExit):
        parse("no-such-estimator")
    offered = re.search(r"invalid choice: '?no-such-estimator'? \(choose from (.*)\)", capsys.readouterr().err)
    assert offered and set(re.findall(r"\w+", offered.group(1))) == set(ESTIMATORS)  # and nothing else

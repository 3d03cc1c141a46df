"""Output-length rankers: metrics on hand cases, online refresh, learned vs random, `rank eval`."""

import json
import random
import threading

import numpy as np
import pytest

from streamrl.ranker.base import make_ranker
from streamrl.lab.rank_eval import (Prediction, evaluate, group_metrics, group_oracle, prompt_folds, reference_rows,
                                      streaming)
from streamrl.ranker.history import BlendRanker, HistoryRanker
from streamrl.ranker.records import QWEN_MATH_FILE, LengthRecord, load_samples_jsonl
from streamrl.ranker.learned import LearnedRanker, RidgeRanker, ngram_buckets, position_codes
from streamrl.ranker.metrics import average_ranks, ceiling_scores, rank_metrics, recall_at_top, spearman
from streamrl.tasks.base import default_data_dir


# -- metrics -------------------------------------------------------------------------------------
def test_recall_perfect_reversed_and_partial():
    true = np.arange(1, 11, dtype=float)  # k = 2 for 20% of 10
    assert recall_at_top(true, true, 0.2) == 1.0
    assert recall_at_top(true, -true, 0.2) == 0.0
    scores = true.copy()
    scores[9] = 0.0  # the longest predicted shortest: finds 9 of the top {9, 10} only
    assert recall_at_top(true, scores, 0.2) == 0.5


def test_recall_constant_scores_is_exactly_random():
    true = np.array([5.0, 1.0, 9.0, 3.0, 7.0, 2.0, 8.0, 4.0, 6.0, 0.5])
    assert recall_at_top(true, np.zeros(10), 0.3) == pytest.approx(0.3)


def test_recall_ties_are_expected_over_random_tie_breaking():
    # true top-2 of [3, 2, 2, 1]: sample 0, and one of samples 1/2 -> memberships [1, .5, .5, 0];
    # predicted top-2 of [0, 1, 0, 0]: sample 1, and one of 0/2/3 -> [1/3, 1, 1/3, 1/3].
    got = recall_at_top([3, 2, 2, 1], [0, 1, 0, 0], 0.5)
    assert got == pytest.approx((1 * 1 / 3 + 0.5 * 1 + 0.5 * 1 / 3) / 2)
    # brute force: average over all tie-breaking orders agrees
    rng = np.random.default_rng(0)
    trials = []
    for _ in range(4000):
        jt, js = rng.random(4) * 1e-6, rng.random(4) * 1e-6
        trials.append(recall_at_top(np.array([3, 2, 2, 1]) + jt, np.array([0, 1, 0, 0]) + js, 0.5))
    assert np.mean(trials) == pytest.approx(got, abs=0.02)


def test_recall_rejects_bad_input():
    with pytest.raises(ValueError, match="differ in length"):
        recall_at_top([1, 2, 3], [1, 2], 0.5)
    with pytest.raises(ValueError, match="frac"):
        recall_at_top([1, 2], [1, 2], 0.0)
    with pytest.raises(ValueError, match="non-finite"):
        recall_at_top([1, float("nan")], [1, 2], 0.5)


def test_average_ranks_and_spearman_with_ties():
    assert average_ranks([10, 20, 20, 30]).tolist() == [1.0, 2.5, 2.5, 4.0]
    a, b = [1, 2, 3, 4, 5], [5, 6, 7, 8, 7]
    ra, rb = np.array([1, 2, 3, 4, 5.0]), np.array([1, 2, 3.5, 5, 3.5])
    assert spearman(a, b) == pytest.approx(np.corrcoef(ra, rb)[0, 1])
    assert spearman(a, [x ** 3 for x in a]) == pytest.approx(1.0)
    assert spearman(a, [-x for x in a]) == pytest.approx(-1.0)
    assert np.isnan(spearman(a, [1] * 5))
    try:
        from scipy.stats import spearmanr
    except ImportError:
        return
    x, y = np.random.default_rng(1).integers(0, 5, (2, 50))
    assert spearman(x, y) == pytest.approx(spearmanr(x, y).statistic)


def test_ceiling_is_mean_of_other_or_seen_samples():
    keys, lens = ["a", "a", "b", "b", "b"], [1, 3, 2, 4, 6]
    assert ceiling_scores(keys, lens).tolist() == [3, 1, 5, 4, 3]
    got = ceiling_scores(["a", "b", "c"], [0, 0, 0], ref_keys=["a", "a", "b"], ref_lengths=[2, 4, 9])
    assert got.tolist() == [3, 9, 5]  # unseen prompt "c" gets the reference mean: no information


# -- rankers -------------------------------------------------------------------------------------
def test_factory_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown ranker 'oracle'.*known"):
        make_ranker("oracle")
    assert isinstance(make_ranker("history", decay=0.5), HistoryRanker)
    with pytest.raises(ValueError, match="decay"):
        make_ranker("history", decay=0.0)


def test_rankers_reject_bad_lengths_with_the_values():
    with pytest.raises(ValueError, match=r"-3\.0"):
        HistoryRanker().fit(["p", "q"], [1.0, -3.0])
    with pytest.raises(RuntimeError, match="before fit"):
        LearnedRanker().score(["p"])


def test_history_ranker_follows_the_policy_after_update():
    hist = HistoryRanker(decay=0.5)
    hist.fit(["a", "a", "b", "b"], [900, 1100, 100, 120])
    assert np.argmax(hist.score(["a", "b"])) == 0
    for _ in range(2):  # the policy now writes long answers to b and short ones to a
        hist.update(["a", "b"], [50, 2000])
    assert np.argmax(hist.score(["a", "b"])) == 1
    assert hist.history_count("a") == pytest.approx(2 * 0.25 + 0.5 + 1)


def test_history_unseen_prompt_gets_recent_median():
    hist = HistoryRanker(space="linear").fit(["a", "b", "c"], [10, 20, 30])
    assert hist.score(["zzz"]).tolist() == [20.0]


def toy_records(n_prompts=240, samples=2, seed=0):
    """Length is a clear function of the text: number of items to list and whether it says 'prove'."""
    rng = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "lamp", "seed", "wolf", "coin"]
    out = []
    for i in range(n_prompts):
        items = rng.randint(1, 12)
        prove = rng.random() < 0.3
        text = (f"Problem {i}: " + ("prove that " if prove else "compute ") +
                " ".join(rng.choice(words) for _ in range(items)) + " ;" * items)
        for _ in range(samples):
            length = (30 * items + (400 if prove else 0)) * rng.uniform(0.8, 1.25)
            out.append(LengthRecord(f"k{i}", text, length))
    return out


def test_learned_ranker_beats_random_on_held_out_toy_prompts():
    preds = prompt_folds(toy_records(), lambda: LearnedRanker(), k=4)
    true = np.concatenate([[r.length for r in p.records] for p in preds])
    scores = np.concatenate([p.scores for p in preds])
    m = rank_metrics(true, scores)
    assert m["spearman"] > 0.7
    assert m["recall@20%"] > 0.6  # random: 0.2


def test_learned_ranker_scores_1000_prompts_in_one_tree_pass_without_refitting(monkeypatch):
    import streamrl.ranker.learned as learned
    from streamrl.ranker.trees import BoostedTrees

    recs = toy_records(n_prompts=500, samples=1)
    ranker = LearnedRanker().fit([r.text for r in recs], [r.length for r in recs])
    assert ranker.params_["blend"] < 1.0  # the trees take part in the score

    def no_fit(*args, **kwargs):
        raise AssertionError("scoring fitted trees")

    monkeypatch.setattr(learned, "fit_boosted_trees", no_fit)
    passes, predict = [], BoostedTrees.predict
    monkeypatch.setattr(BoostedTrees, "predict", lambda self, x: passes.append(len(x)) or predict(self, x))
    texts = [r.text * 3 for r in recs] * 2  # 1,000 prompts of a few hundred characters
    scores = ranker.score(texts)
    assert scores.shape == (1000,) and passes == [1000]  # one vectorised pass over the whole batch
    assert np.allclose(scores[:5], [ranker.score([t])[0] for t in texts[:5]])  # what each alone gets


def interaction_records(n_prompts=300, seed=0):
    """Length set by the first letter x the last digit: A counts up with the digit, B down.

    Each letter and each digit alone says nothing about the length (the two halves cancel), and
    filler words of random length sit between them, so no n-gram spans both ends.
    """
    rng = random.Random(seed)
    words = ["apple", "river", "stone", "cloud", "lamp", "seed", "wolf", "coin"]
    out = []
    for i in range(n_prompts):
        letter, digit = rng.choice("AB"), rng.randrange(10)
        text = f"{letter} " + " ".join(rng.choice(words) for _ in range(rng.randint(2, 6))) + f" {digit}"
        steps = digit if letter == "A" else 9 - digit
        out.append(LengthRecord(f"k{i}", text, (20 + 40 * steps) * rng.uniform(0.9, 1.1)))
    return out


def test_learned_ranker_learns_an_interaction_the_ridge_cannot():
    recs = interaction_records()

    def held_out_spearman(factory):
        preds = prompt_folds(recs, factory, k=3)
        true = np.concatenate([[r.length for r in p.records] for p in preds])
        return spearman(true, np.concatenate([p.scores for p in preds]))

    ridge, learned = held_out_spearman(RidgeRanker), held_out_spearman(LearnedRanker)
    assert abs(ridge) < 0.3  # the additive parts cancel: nothing linear to learn
    assert learned > 0.8 and learned > ridge + 0.5


def test_learned_ranker_is_deterministic_and_reports_its_choices():
    recs = interaction_records(n_prompts=120, seed=3)
    texts, lens = [r.text for r in recs], [r.length for r in recs]
    a, b = LearnedRanker(seed=5).fit(texts, lens), LearnedRanker(seed=5).fit(texts, lens)
    assert np.array_equal(a.score(texts), b.score(texts))
    assert a.params_ == b.params_ and a.params_["rounds"] > 0 and a.params_["blend"] < 1.0
    a.update(texts[:10], lens[:10])
    b.update(texts[:10], lens[:10])
    assert np.array_equal(a.score(texts), b.score(texts))
    few = LearnedRanker().fit(texts[:10], lens[:10])  # under 5 * cv_folds prompts: the ridge alone
    assert few.params_["blend"] == 1.0 and few.params_["rounds"] == 0


def test_position_codes_align_both_ends():
    got = position_codes(["abc", "x"], 2)
    assert got.tolist() == [[97, 98, 99, 98], [120, -1, 120, -1]]


def test_ngram_hash_is_stable_across_processes():
    # Python's str hash is salted per process; ours must not be (models are saved and reloaded).
    assert ngram_buckets("ab", (1, 2), 13).tolist() == ngram_buckets("ab", (1, 2), 13).tolist()
    assert ngram_buckets("ab", (1, 2), 13).size == 3


def test_blend_uses_learned_for_new_prompts_and_history_for_known_ones():
    recs = toy_records(n_prompts=120, samples=4)
    blend = BlendRanker(prior_count=1.0)
    blend.fit([r.text for r in recs], [r.length for r in recs], [r.key for r in recs])
    new = "Problem 999: prove that wolf wolf wolf wolf ; ; ; ;"
    assert blend.score([new], ["new"]) == pytest.approx(blend.prior.score([new]))
    # a known prompt whose policy suddenly writes very long answers moves up after updates
    short_key = min(recs, key=lambda r: r.length)
    for _ in range(3):
        blend.update([short_key.text] * 4, [5000.0] * 4, [short_key.key] * 4)
    scores = blend.score([r.text for r in recs], [r.key for r in recs])
    assert scores[recs.index(short_key)] == scores.max()


def test_update_from_a_background_thread_while_scoring():
    recs = toy_records(n_prompts=60, samples=1)
    texts, lens, keys = [r.text for r in recs], [r.length for r in recs], [r.key for r in recs]
    blend = BlendRanker().fit(texts, lens, keys)
    errors = []

    def refresh():
        try:
            for _ in range(3):
                blend.update(texts[:20], [x * 2 for x in lens[:20]], keys[:20])
        except Exception as exc:  # surfaced by the assert below
            errors.append(exc)

    t = threading.Thread(target=refresh)
    t.start()
    while t.is_alive():
        assert np.all(np.isfinite(blend.score(texts, keys)))
    t.join()
    assert not errors


# -- evaluation ----------------------------------------------------------------------------------
def test_streaming_protocol_never_scores_what_it_has_seen(tmp_path):
    rows = [{"key": f"p{i}", "text": f"prompt {i}", "length": 10.0 * (i + 1) + step, "step": step}
            for step in range(3) for i in range(10)]
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    recs = load_samples_jsonl(path)
    preds = streaming(recs, lambda: HistoryRanker())
    assert [p.batch for p in preds] == ["step 1", "step 2"]
    for p in preds:
        assert all(s.step < p.records[0].step for s in p.seen)
    table = {r["ranker"]: r for r in evaluate("streaming", recs, ["history"]) if r["unit"] == "sample"}
    assert table["history"]["spearman"] == pytest.approx(1.0)
    assert table["random"]["recall@20%"] == pytest.approx(0.2)


def test_streaming_steps_can_come_from_a_named_column_with_several_warmup_steps(tmp_path):
    from streamrl.lab.rank_eval import run_suite

    # a rollout log: iterations 0-3 over 2 epochs of the same 10 prompts
    rows = [{"key": f"p{i}", "text": f"prompt {i}", "length": 10.0 * (i + 1) + it, "iteration": it, "epoch": it // 2}
            for it in range(4) for i in range(10)]
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    assert sorted({r.step for r in load_samples_jsonl(path, step_field="epoch")}) == [0, 1]
    with pytest.raises(ValueError, match="missing fields \\['version'\\]"):
        load_samples_jsonl(path, step_field="version")
    by_iter = load_samples_jsonl(path, step_field="iteration")
    preds = streaming(by_iter, lambda: HistoryRanker(), warmup_steps=2)
    assert [p.batch for p in preds] == ["step 2", "step 3"]
    assert {s.step for s in preds[0].seen} == {0, 1}
    (title, table, note), = run_suite("samples", tmp_path, ["history"], file=path, protocols=["streaming"],
                                      step_field="iteration", warmup_steps=3)
    assert "'iteration'" in note and {r["batches"] for r in table if r["ranker"] == "history"} == {1}


def test_run_suite_runs_only_the_protocols_asked_for(tmp_path):
    from streamrl.lab.rank_eval import run_suite

    rows = [{"key": f"p{i}", "text": f"prompt {i}", "length": 10.0 * (i + 1) + step, "step": step}
            for step in range(3) for i in range(10)]
    path = tmp_path / "samples.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    every = run_suite("samples", tmp_path, ["history"], file=path)
    assert [t.split(": ")[1] for t, _, _ in every] == ["streaming over 3 steps", "held-out prompts",
                                                         "held-out samples of seen prompts"]
    only = run_suite("samples", tmp_path, ["history"], file=path, protocols=["prompts"])
    assert [t.split(": ")[1] for t, _, _ in only] == ["held-out prompts"]
    def same(rows):  # the wall time differs, and Spearman is NaN (every history score equal)
        return [{k: v for k, v in r.items() if k not in ("fit_s", "spearman")} for r in rows]
    assert same(only[0][1]) == same(every[1][1])
    with pytest.raises(ValueError, match="none of the protocols \\['transfer'\\]"):
        run_suite("samples", tmp_path, ["history"], file=path, protocols=["transfer"])


def test_rank_eval_on_real_qwen_math(tmp_path):
    if not (default_data_dir() / QWEN_MATH_FILE).exists():
        pytest.skip(f"{QWEN_MATH_FILE} not in {default_data_dir()} (set STREAMRL_DATA_DIR)")
    from streamrl.cli import main

    out = tmp_path / "rank.json"
    assert main(["rank", "eval", "--data", "qwen-math", "--ranker", "history", "--ranker", "learned",
                 "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    by = {(r["setting"], r["unit"], r["ranker"]): r for r in rows}
    samples = "qwen-math: held-out samples of seen prompts"
    assert by[(samples, "sample", "history")]["recall@20%"] > 0.5 > by[(samples, "sample", "random")]["recall@20%"]
    held = "qwen-math: held-out prompts"
    assert by[(held, "sample", "ceiling (seen)")]["recall@20%"] == pytest.approx(0.2)  # nothing seen of these
    assert by[(held, "sample", "learned")]["spearman"] > 0.2
    assert by[(held, "group-mean", "learned")]["n"] == 100  # one row per prompt: its 8 samples are one group
    assert by[(held, "group-mean", "oracle (half vs half)")]["spearman"] > 0.5


def test_group_metrics_hand_worked():
    # three prompts of two samples each in one batch; scores of prompt c differ but average to 2
    lens = {"a": [10, 40], "b": [50, 50], "c": [1, 60]}  # means 25 / 50 / 30.5, maxes 40 / 50 / 60
    recs = [LengthRecord(k, k, x) for k, xs in lens.items() for x in xs]
    pred = Prediction("batch", recs, np.array([1.0, 1.0, 3.0, 3.0, 1.5, 2.5]), [])
    mean = group_metrics([pred], lambda p: p.scores, "group-mean")
    assert mean["n"] == 3 and mean["spearman"] == pytest.approx(1.0) and mean["recall@20%"] == 1.0  # b > c > a
    top = group_metrics([pred], lambda p: p.scores, "group-max")
    assert top["spearman"] == pytest.approx(0.5)  # truth c > b > a, scores b > c > a
    assert top["recall@20%"] == 0.0  # top-1 group is c (max 60), predicted b
    # no sample outside the groups: one half ranks the other (a 10|40, b 50|50, c 1|60), both ways
    half = group_oracle([pred], recs, "group-mean")
    assert half["ranker"] == "oracle (half vs half)" and half["spearman"] == pytest.approx(-0.5)
    extra = [LengthRecord("a", "a", 5.0), LengthRecord("b", "b", 7.0), LengthRecord("c", "c", 9.0)]
    other = group_oracle([pred], recs + extra, "group-mean")  # scores c > b > a, truth b > c > a
    assert other["ranker"] == "oracle (other samples)" and other["spearman"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="'group-median'.*known"):
        group_metrics([pred], lambda p: p.scores, "group-median")


def test_task_solution_diagnostic_row_only_for_synthetic_prompts():
    from streamrl.tasks.synthetic import solve

    # "U 95,1:" -> "96 97 98 99 100 =100" (20 chars); "U 10,3:" is longer; "D 503,3:" shorter
    texts = ["U 95,1:", "U 10,3:", "D 503,3:", "U 98,1:"]
    assert len(solve("U 95,1:")[0]) == 20
    policy = [30.0, 5.0, 12.0, 8.0]  # the policy's lengths, unlike the solutions'
    recs = [LengthRecord(t, t, x) for t, x in zip(texts, policy)]
    pred = Prediction("batch", recs, np.zeros(4), [])
    rows = {r["ranker"]: r for r in reference_rows([pred], recs)}
    sol = [float(len(solve(t)[0])) for t in texts]
    assert rows["task solution (diagnostic)"]["spearman"] == pytest.approx(rank_metrics(policy, sol)["spearman"])
    math = [LengthRecord("q", "What is 2+2?", 5.0), LengthRecord("r", "U 95,1:", 9.0)]
    names = {r["ranker"] for r in reference_rows([Prediction("b", math, np.zeros(2), [])], math)}
    assert "task solution (diagnostic)" not in names  # one text is not a synthetic prompt


def test_bare_rank_command_prints_help(capsys):
    from streamrl.cli import main

    assert main(["rank"]) == 2
    assert "eval" in capsys.readouterr().out


# -- online use in the SGS -----------------------------------------------------------------------
def test_online_history_restored_into_a_fresh_ranker_predicts_the_same():
    from streamrl.ranker.online import OnlineRanker

    keys, texts = ["p0", "p1", "p2", "p3"], ["D 9,1:", "S 1:", "U 1,1,9:", "S 12:"]
    first, resumed = OnlineRanker(HistoryRanker(decay=0.3)), OnlineRanker(HistoryRanker(decay=0.3))
    try:
        for online in (first, resumed):
            online.register(keys, texts)
        for lengths in ([100, 5, 50, 10], [90, 7, 40, 12]):
            first.observe(keys, lengths)
        assert first.wait(timeout=30)
        state = first.history_state()  # what a checkpoint keeps
        assert state == {"batches": [[keys, [100.0, 5.0, 50.0, 10.0]], [keys, [90.0, 7.0, 40.0, 12.0]]]}
        resumed.restore(state)
        assert resumed.predict(keys).tolist() == first.predict(keys).tolist()
    finally:
        first.close()
        resumed.close()


def test_online_refresh_changes_the_ranking_after_the_policys_lengths_change():
    from streamrl.ranker.online import OnlineRanker

    online = OnlineRanker(HistoryRanker(decay=0.3), default_length=10.0)
    keys, texts = ["p0", "p1", "p2", "p3"], ["D 9,1:", "S 1:", "U 1,1,9:", "S 12:"]
    online.register(keys, texts)
    try:
        assert online.predict(keys).tolist() == [10.0] * 4  # cold: all equal until the first refresh
        online.observe(keys, [100, 5, 50, 10])
        assert online.wait(timeout=30)
        first = online.predict(keys)
        assert list(np.argsort(-first)) == [0, 2, 3, 1]
        for _ in range(3):  # the policy changed: p1 now writes long answers, p0 short ones
            online.observe(keys, [5, 120, 50, 10])
        assert online.wait(timeout=30)
        after = online.predict(keys)
        assert np.argmax(after) == 1 and np.argmin(after) == 0
        assert online.metrics()["rank/refreshes"] == 4
    finally:
        online.close()


class _GatedRanker(HistoryRanker):
    """A real history ranker whose ``update`` waits for a gate: holds a refresh mid-way."""

    def __init__(self):
        super().__init__(space="linear")
        self.gate, self.entered = threading.Event(), threading.Event()

    def update(self, texts, lengths, keys=None):
        self.entered.set()
        self.gate.wait(30)
        super().update(texts, lengths, keys)


def test_prediction_never_waits_for_a_refresh_and_sees_the_new_table_after():
    from streamrl.ranker.online import OnlineRanker

    ranker = _GatedRanker()
    online = OnlineRanker(ranker)
    online.register(["a", "b"], ["A", "B"])
    try:
        online.fit(["a", "b"], ["A", "B"], [100.0, 1.0])
        online.observe(["a", "b", "a", "b"], [1.0, 1000.0, 1.0, 1000.0])
        assert ranker.entered.wait(30)  # the refresh is running (and blocked) on its thread
        assert online.predict(["a", "b"]).tolist() == [100.0, 1.0]  # the old table, answered at once
        ranker.gate.set()
        assert online.wait(timeout=30)
        new = online.predict(["a", "b"])
        assert new[1] > new[0]
    finally:
        ranker.gate.set()
        online.close()


def test_online_ranker_rejects_bad_lengths_and_skips_unregistered_prompts():
    from streamrl.ranker.online import OnlineRanker

    online = OnlineRanker(HistoryRanker())
    online.register(["a"], ["A"])
    try:
        with pytest.raises(ValueError, match=r"\('a', -2.0\)"):
            online.observe(["a"], [-2.0])
        online.observe(["a", "eval-7"], [5.0, 9.0])
        assert online.wait(timeout=30)
        assert online.metrics()["rank/unregistered_skipped"] == 1
        assert online.predict(["eval-7"]).tolist() == [1.0]  # never registered: the default, counted
        assert online.metrics()["rank/unknown"] == 1
    finally:
        online.close()


def test_batch_rank_metrics_hand_worked():
    from streamrl.ranker.online import batch_rank_metrics

    actual = list(range(1, 21))  # k = 4 / 2 / 1 of 20
    pred = actual[:]
    pred[19], pred[0] = pred[0], pred[19]  # the longest is predicted shortest
    m = batch_rank_metrics(pred, actual)
    assert m["rank/recall@20%"] == pytest.approx(3 / 4)  # 17, 18, 19 found; 20 missed (1 took its place)
    assert m["rank/recall@10%"] == pytest.approx(1 / 2)
    assert m["rank/recall@5%"] == 0.0
    assert -1 < m["rank/spearman"] < 1
    with pytest.raises(ValueError, match="3 predictions but 2"):
        batch_rank_metrics([1, 2, 3], [1, 2])

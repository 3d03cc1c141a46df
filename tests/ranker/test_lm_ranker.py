"""The language-model length ranker (``ranker lm``): fine-tuned on the policy, its prior in blends."""

from __future__ import annotations

import random

import numpy as np
import pytest

from streamrl.ranker.base import make_ranker
from streamrl.lab.rank_eval import prompt_folds
from streamrl.ranker.records import LengthRecord
from streamrl.ranker.metrics import spearman


def _lm(policy_dir, **kw):
    import torch

    torch.set_num_threads(1)
    return make_ranker("lm", policy_path=policy_dir, **{"epochs": 60, "lr": 3e-3, **kw})


def synthetic_solution_records(n_prompts, seed=0):
    """Synthetic-task prompts with the length of their correct response (the task's arithmetic)."""
    from streamrl.tasks.synthetic import make_problem, solve

    rng = random.Random(seed)
    texts = [make_problem(rng)[0] for _ in range(n_prompts)]
    return [LengthRecord(f"s{i}", t, float(len(solve(t)[0]))) for i, t in enumerate(texts)]


@pytest.mark.slow
def test_lm_ranker_learns_lengths_of_held_out_prompts(tiny_policy_dir):
    """The paper's ranker: the policy's network, fine-tuned, ranks prompts it never saw."""
    recs = synthetic_solution_records(240)
    preds = prompt_folds(recs, lambda: _lm(tiny_policy_dir), k=3)
    true = np.concatenate([[r.length for r in p.records] for p in preds])
    assert spearman(true, np.concatenate([p.scores for p in preds])) > 0.5  # ~0.7 here; random 0


@pytest.mark.slow
def test_lm_ranker_starts_constant_and_fine_tunes_once_it_has_enough_prompts(tiny_policy_dir):
    recs = synthetic_solution_records(120, seed=2)
    texts, lens = [r.text for r in recs], [r.length for r in recs]
    ranker = _lm(tiny_policy_dir, min_prompts=50)
    ranker.fit(texts[:10], lens[:10])
    cold = ranker.score(texts)
    assert np.all(cold == cold[0]) and ranker.params_["epochs"] == 0  # too few prompts: the mean
    ranker.update(texts[10:], lens[10:])  # crosses min_prompts: a full fit
    assert ranker.params_["prompts"] == len(set(texts)) and ranker.params_["epochs"] >= 1
    assert spearman(lens, ranker.score(texts)) > 0.5
    before = ranker.score(texts)
    ranker.update(texts[:20], [2 * n for n in lens[:20]])  # online refresh continues from the current net
    assert ranker.params_["updates"] == 1 and not np.array_equal(before, ranker.score(texts))


@pytest.mark.slow
def test_lm_ranker_needs_a_model_and_names_bad_settings(tiny_policy_dir):
    with pytest.raises(ValueError, match="model_path"):
        make_ranker("lm")
    with pytest.raises(ValueError, match="epochs must be >= 1, got 0"):
        make_ranker("lm", policy_path=tiny_policy_dir, epochs=0)
    with pytest.raises(ValueError, match="val_frac"):
        make_ranker("lm", model_path=tiny_policy_dir, val_frac=1.5)
    with pytest.raises(RuntimeError, match="before fit"):
        make_ranker("lm", policy_path=tiny_policy_dir).score(["U 95,1:"])


def test_rank_eval_lm_without_a_model_says_so():
    from streamrl.cli import main

    with pytest.raises(SystemExit, match="--model"):
        main(["rank", "eval", "--data", "samples", "--file", "x.jsonl", "--ranker", "lm"])


@pytest.mark.slow
def test_blend_with_the_lm_prior_scores_new_prompts_by_the_fine_tuned_policy(tiny_policy_dir):
    from streamrl.ranker.finetuned import FinetunedLMRanker

    recs = synthetic_solution_records(60, seed=4)
    blend = make_ranker("blend", policy_path=tiny_policy_dir, prior="lm", learned={"epochs": 3})
    assert isinstance(blend.prior, FinetunedLMRanker) and blend.prior.model_path == tiny_policy_dir
    blend.fit([r.text for r in recs[:40]], [r.length for r in recs[:40]], [r.key for r in recs[:40]])
    new = recs[40:]
    assert np.allclose(blend.score([r.text for r in new], [r.key for r in new]),
                       blend.prior.score([r.text for r in new]))
    assert blend.prior.loo_rmse_ is not None and blend.prior_count_ > 0
    with pytest.raises(ValueError, match="blend prior must be"):
        make_ranker("blend", prior="trees")


@pytest.mark.slow
def test_the_sgs_builds_lm_rankers_from_the_runs_policy(tiny_policy_dir):
    from streamrl.config import load_config
    from streamrl.ranker.online import make_online_ranker

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "ranker.name=lm"])
    assert make_online_ranker(cfg).ranker.model_path == tiny_policy_dir
    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "ranker.name=blend", "ranker.kwargs={prior: lm}"])
    assert make_online_ranker(cfg).ranker.prior.model_path == tiny_policy_dir

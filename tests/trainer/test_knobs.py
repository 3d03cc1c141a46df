"""The algorithm knobs users of TRL and verl expect: clip-higher, loss aggregation, KL estimators,
entropy bonus, learning-rate warmup and decay, overlong filter and penalty, dynamic sampling and
the dapo preset, each from the config to its effect."""

import dataclasses
import math

import pytest
import torch

from streamrl.config import load_config
from streamrl.controller.common import group_samples
from streamrl.trainer import losses
from streamrl.trainer.schedule import lr_at
from streamrl.trainer.trainer import Trainer
from tests.helpers import real_samples

PAIRS = [("D 23,7,0:", "16 9 2 =2"), ("D 23,7,0:", "16 9 =9"), ("S 4819:", "4 12 13 22 =22"),
         ("S 4819:", "4 12 =12"), ("U 5,3,10:", "8 11 =11"), ("U 5,3,10:", "8 =8")]


def test_the_three_loss_aggregations_on_hand_values():
    per_token = torch.tensor([[1.0, 2.0, 3.0, 0.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])
    assert losses._aggregate(per_token, mask, "token-mean", None).item() == pytest.approx(10 / 4)
    assert losses._aggregate(per_token, mask, "seq-mean-token-mean", None).item() == pytest.approx((2 + 4) / 2)
    assert losses._aggregate(per_token, mask, "seq-mean", None).item() == pytest.approx(3.0)  # the old name
    assert losses._aggregate(per_token, mask, "seq-mean-token-sum", None).item() == pytest.approx((6 + 4) / 2)
    with pytest.raises(ValueError, match="unknown loss_agg 'mean'"):
        losses._aggregate(per_token, mask, "mean", None)


def test_decoupled_loss_takes_clip_higher_too():
    logp = torch.log(torch.tensor([[1.25, 0.75]]))
    zero = torch.zeros(1, 2)
    adv, mask = torch.ones(1, 2), torch.ones(1, 2)
    _, sym = losses.decoupled_policy_loss(logp, zero, zero, adv, mask, clip_eps=0.2)
    _, high = losses.decoupled_policy_loss(logp, zero, zero, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    assert sym["clip_frac"] == 0.5 and high["clip_frac"] == 0.0  # ratio 1.25 clips at 1.2, not at 1.28


def test_overlong_penalty_is_zero_then_linear_then_the_cap():
    assert losses.overlong_penalty(80, 100, 20) == 0.0
    assert losses.overlong_penalty(90, 100, 20) == pytest.approx(-0.5)
    assert losses.overlong_penalty(100, 100, 20, penalty=2.0) == -2.0
    assert losses.overlong_penalty(99, 100, 0) == 0.0 and losses.overlong_penalty(100, 100, 0) == -1.0


def test_learning_rate_warmup_then_constant_or_cosine():
    const = load_config(None, ["trainer.lr=1.0", "trainer.lr_warmup_steps=4"]).trainer
    assert [lr_at(const, s, 10) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    cos = load_config(None, ["trainer.lr=1.0", "trainer.lr_warmup_steps=2", "trainer.lr_schedule=cosine",
                             "trainer.lr_min_ratio=0.1"]).trainer
    lrs = [lr_at(cos, s, 10) for s in range(12)]  # decay to step 10 (run.iterations x epochs when 0)
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[6] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 2)))
    assert lrs[10] == pytest.approx(0.1) and lrs[11] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))


def test_the_dapo_preset_fills_what_the_config_leaves_unset():
    t = load_config(None, ["trainer.preset=dapo"]).trainer
    assert (t.clip_eps, t.clip_eps_high, t.loss_agg, t.kl_coef, t.overlong, t.dynamic_sampling) == \
        (0.2, 0.28, "token-mean", 0.0, "penalty", True)
    t = load_config(None, ["trainer.preset=dapo", "trainer.clip_eps_high=0.3", "trainer.overlong=filter"]).trainer
    assert t.clip_eps_high == 0.3 and t.overlong == "filter" and t.dynamic_sampling


def _groups(tr, rewards, truncated=()):
    samples = real_samples(tr.model, tr.tokenizer, PAIRS, rewards)
    samples = [dataclasses.replace(s, completion=dataclasses.replace(s.completion, finish_reason="length"))
               if i in truncated else s for i, s in enumerate(samples)]
    groups = tr.prepare_groups(group_samples(samples))  # prepare_samples, then the reference's pass
    tr.set_group_advantages(groups)
    return groups


def _trainer(policy_dir, *overrides):
    return Trainer(load_config(None, [f"policy.path={policy_dir}", "trainer.lr=1e-2", *overrides]))


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
def test_dynamic_sampling_drops_constant_groups_from_the_loss_and_skips_a_step_with_none_left(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir, "trainer.dynamic_sampling=true")
    flat = [p for g in _groups(tr, [1.0, 1.0, 0.0, 0.0, 1.0, 0.0]) for p in g]
    assert [p.trained_tokens > 0 for p in flat] == [False, False, False, False, True, True]
    before = _params(tr.model).clone()
    m = tr.train_step(flat)
    assert m["train/zero_signal_samples"] == 4 and not torch.equal(before, _params(tr.model))
    before = _params(tr.model).clone()
    m = tr.train_step([p for g in _groups(tr, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]) for p in g])
    assert m["train/skipped_step"] == 1.0 and torch.equal(before, _params(tr.model)) and tr.steps == 1


@pytest.mark.slow
def test_overlong_filter_trains_nothing_on_a_truncated_response_and_the_penalty_lowers_its_reward(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir, "trainer.overlong=filter")
    groups = _groups(tr, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], truncated={0})
    assert groups[0][0].trained_tokens == 0 and groups[0][1].trained_tokens > 0
    assert groups[0][0].advantages[0] > 0  # it still counts in its group's statistics
    assert tr.train_step([p for g in groups for p in g])["train/filtered_samples"] == 1
    tr = _trainer(tiny_policy_dir, "trainer.overlong=penalty", "generation.max_new_tokens=4",
                  "trainer.overlong_buffer=2")
    groups = _groups(tr, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0])
    lengths = [p.num_response_tokens for g in groups for p in g]
    rewards = [p.reward for g in groups for p in g]
    assert rewards == [r + losses.overlong_penalty(n, 4, 2) for r, n in zip([1.0, 0.0, 1.0, 0.0, 1.0, 0.0], lengths)]
    assert min(rewards) == -1.0  # a response at the cap


@pytest.mark.slow
def test_entropy_bonus_raises_entropy_and_the_kl_estimator_reaches_the_loss(tiny_policy_dir, monkeypatch):
    def entropy_after(coef):
        tr = _trainer(tiny_policy_dir, f"trainer.entropy_coef={coef}", "trainer.lr=3e-3")
        groups = _groups(tr, [1.0, 1.0, 0.0, 0.0, 1.0, 1.0])  # zero advantages: only the bonus moves it
        items = [p for g in groups for p in g]
        for _ in range(3):
            tr.train_step(items)
        return tr.train_step(items)["train/entropy"]

    assert entropy_after(1.0) > entropy_after(0.0) + 1e-3
    kinds = []
    real = losses.kl_penalty
    monkeypatch.setattr(losses, "kl_penalty", lambda *a, kind="k3", **k: kinds.append(kind) or real(*a, kind=kind, **k))
    tr = _trainer(tiny_policy_dir, "trainer.kl_coef=0.1", "trainer.kl_estimator=k2")
    m = tr.train_step([p for g in _groups(tr, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]) for p in g])
    assert kinds == ["k2"] and m["train/kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the step


@pytest.mark.slow
def test_the_trainer_follows_the_learning_rate_schedule_and_seq_mean_losses_train(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir, "trainer.lr_warmup_steps=2", "trainer.lr_schedule=cosine",
                  "trainer.lr_decay_steps=4", "trainer.loss_agg=seq-mean-token-sum")
    items = [p for g in _groups(tr, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]) for p in g]
    lrs = [tr.train_step(items)["train/lr"] for _ in range(5)]
    assert lrs == pytest.approx([lr_at(tr.tcfg, s, 0) for s in range(5)]) and lrs[0] == pytest.approx(5e-3)
    assert lrs[4] == pytest.approx(0.0, abs=1e-12)


@pytest.mark.slow
def test_activation_checkpointing_gives_the_same_update(tiny_policy_dir):
    """Recomputing each block's activations in backward changes memory, not the gradient."""
    a, b = _trainer(tiny_policy_dir), _trainer(tiny_policy_dir, "trainer.activation_checkpointing=true")
    flag = "is_activation_checkpointing" if hasattr(a.model, "is_activation_checkpointing") else "is_gradient_checkpointing"
    assert getattr(b.model, flag) and not getattr(a.model, flag)
    for tr in (a, b):
        tr.train_step([p for g in _groups(tr, [1.0, 0.0, 1.0, 0.0, 1.0, 0.0]) for p in g])
    torch.testing.assert_close(_params(a.model), _params(b.model), atol=1e-6, rtol=0)

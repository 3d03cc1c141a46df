"""Trainer: real gradient steps, micro-batching, PPO/GRPO preparation, exact resume."""

import pytest
import torch

from streamrl.config import load_config
from streamrl.trainer.trainer import Prepared, Trainer, dynamic_batches, micro_batches
from tests.helpers import real_samples

PAIRS = [("D 23,7,0:", "16 9 2 =2"), ("D 23,7,0:", "16 9 =9"), ("S 4819:", "4 12 13 22 =22"),
         ("S 4819:", "4 12 =12"), ("U 5,3,10:", "8 11 =11"), ("U 5,3,10:", "8 =8")]
REWARDS = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0]


def _trainer(policy_dir, *overrides):
    cfg = load_config(None, [f"policy.path={policy_dir}", "trainer.lr=1e-2", *overrides])
    return Trainer(cfg)


def _prepared(tr, algo="grpo"):
    from streamrl.controller.common import group_samples

    samples = real_samples(tr.model, tr.tokenizer, PAIRS, REWARDS)
    groups = [tr.prepare(g) for g in group_samples(samples)]
    if algo == "grpo":
        tr.set_group_advantages(groups)
    return [p for g in groups for p in g]


def _params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


@pytest.mark.slow
def test_train_step_changes_the_policy(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir)
    before = _params(tr.model).clone()
    metrics = tr.train_step(_prepared(tr))
    assert not torch.allclose(before, _params(tr.model))
    assert metrics["train/samples"] == 6 and metrics["train/grad_norm"] > 0


@pytest.mark.slow
def test_constant_reward_group_gets_zero_advantage(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir)
    items = _prepared(tr)
    assert all(a == 0.0 for a in items[4].advantages + items[5].advantages)  # group 'U' rewards 1, 1
    assert items[0].advantages[0] > 0 > items[1].advantages[0]


@pytest.mark.slow
def test_micro_batching_gives_the_same_update_as_one_batch(tiny_policy_dir):
    a = _trainer(tiny_policy_dir, "trainer.micro_batch_tokens=100000")
    b = _trainer(tiny_policy_dir, "trainer.micro_batch_tokens=20")
    # Compare gradients through plain SGD: Adam's first step is ~lr*sign(g), which turns
    # float-rounding noise on near-zero gradients into lr-sized differences.
    a.opt = torch.optim.SGD(a.model.parameters(), lr=1.0)
    b.opt = torch.optim.SGD(b.model.parameters(), lr=1.0)
    items_a, items_b = _prepared(a), _prepared(b)
    assert len(micro_batches(items_b, 20)) == len(items_b) and len(micro_batches(items_a, 100000)) == 1
    a.train_step(items_a)
    b.train_step(items_b)
    assert torch.allclose(_params(a.model), _params(b.model), atol=1e-5)
    assert not torch.allclose(_params(a.model), _params(_trainer(tiny_policy_dir).model), atol=1e-3)


@pytest.mark.slow
def test_ppo_prepares_values_gae_and_trains_the_critic(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir, "trainer.algo=ppo", "trainer.kl_coef=0.1", "trainer.lam=1.0")
    tr.begin_iteration()
    items = _prepared(tr, algo="ppo")
    for p in items:
        assert len(p.advantages) == len(p.returns) == len(p.old_values) == len(p.ref_logprobs) == p.num_response_tokens
    # Zero-initialised value head: values 0, so with gamma=lam=1 the return at the first token is
    # the terminal reward minus the summed k1 KL (0 here: reference == policy).
    assert abs(items[0].returns[0] - 1.0) < 1e-5 and abs(items[1].returns[0]) < 1e-5
    critic_before = torch.cat([p.detach().flatten() for p in tr.critic.parameters()]).clone()
    metrics = tr.train_step(items)
    assert "critic/value_error" in metrics
    assert not torch.allclose(critic_before, torch.cat([p.detach().flatten() for p in tr.critic.parameters()]))


@pytest.mark.slow
def test_checkpoint_resume_is_exact(tiny_policy_dir, tmp_path):
    a = _trainer(tiny_policy_dir)
    a.train_step(_prepared(a))
    a.save_checkpoint(tmp_path / "ck", extra={"stream": {"epoch": 0, "index": 6}})
    torch.manual_seed(123)  # a resumed run restores RNG too
    a.train_step(_prepared(a))
    expected = _params(a.model).clone()

    b = _trainer(tiny_policy_dir)
    extra = b.load_checkpoint(tmp_path / "ck")
    assert extra == {"stream": {"epoch": 0, "index": 6}}
    torch.manual_seed(123)
    b.train_step(_prepared(b))
    assert torch.equal(expected, _params(b.model))


def _group(tokens):
    return [Prepared(input_ids=[0] * tokens, resp_start=1, old_logprobs=[], reward=0.0, version=0, prompt_id="p")]


def test_dynamic_batches_close_when_the_token_budget_fills_and_keep_order():
    groups = [_group(t) for t in (5, 3, 4, 10, 1, 2)]
    cut = dynamic_batches(groups, 8)
    assert [[g[0].num_tokens for g in b] for b in cut] == [[5, 3], [4, 10], [1, 2]]
    assert dynamic_batches(groups, 0) == [groups]
    assert dynamic_batches([], 8) == []


@pytest.mark.slow
def test_batched_prepare_of_many_groups_equals_one_group_at_a_time(tiny_policy_dir):
    """The trainer prepares every group that arrived in one call with shared, length-sorted
    forward passes; each sample must get what a pass of its own group alone gives it."""
    from streamrl.controller.common import group_samples

    tr = _trainer(tiny_policy_dir, "trainer.algo=ppo", "trainer.kl_coef=0.1", "trainer.micro_batch_tokens=40")
    tr.begin_iteration()
    samples = real_samples(tr.model, tr.tokenizer, PAIRS, REWARDS)
    units = [[s] for s in samples] + group_samples(samples)
    one_by_one = [tr.prepare(u) for u in units]
    batched = tr.prepare_groups(units)
    assert [[p.meta["request_id"] for p in g] for g in batched] == [[p.meta["request_id"] for p in g] for g in one_by_one]
    for ga, gb in zip(one_by_one, batched):
        for a, b in zip(ga, gb):
            for attr in ("ref_logprobs", "old_values", "advantages", "returns"):
                assert torch.allclose(torch.tensor(getattr(a, attr)), torch.tensor(getattr(b, attr)), atol=1e-5), attr
    assert any(p.advantages and any(x != 0 for x in p.advantages) for g in batched for p in g)


@pytest.mark.slow
def test_decoupled_correction_keeps_the_proximal_policy_of_the_first_step(tiny_policy_dir):
    """Fresh samples: the first step is plain PPO (ratio 1, weights 1); the proximal log-probs are
    captured then and a second epoch clips against them, not against the moved policy."""
    tr = _trainer(tiny_policy_dir, "trainer.correction=decoupled")
    items = _prepared(tr)
    first = tr.train_step(items)
    assert first["train/is_weight_max"] == pytest.approx(1.0, abs=1e-4) and first["train/approx_kl"] == pytest.approx(0.0, abs=1e-5)
    prox = [list(p.prox_logprobs) for p in items]
    assert all(len(v) == p.num_response_tokens for v, p in zip(prox, items))
    second = tr.train_step(items)
    assert [p.prox_logprobs for p in items] == prox  # kept, not re-captured
    assert abs(second["train/approx_kl"]) > 1e-4  # the policy moved away from the proximal one


@pytest.mark.slow
def test_stale_samples_get_importance_weights_under_tis(tiny_policy_dir):
    tr = _trainer(tiny_policy_dir, "trainer.correction=tis", "trainer.is_cap=1.5")
    items = _prepared(tr)
    for p in items:  # as if sampled by an older policy that put a little less mass on each token
        p.old_logprobs = [lp - 0.2 for lp in p.old_logprobs]
    m = tr.train_step(items)
    assert m["train/is_weight_mean"] == pytest.approx(float(torch.exp(torch.tensor(0.2))), rel=1e-3)
    assert m["train/is_capped_frac"] == 0.0 and m["train/clip_frac"] == 0.0

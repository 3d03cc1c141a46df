"""Loss math against small hand-computed examples (derivations in the comments)."""

import math

import pytest
import torch

from streamrl.models.logprobs import head_logprobs, token_logprobs
from streamrl.trainer.losses import (
    decoupled_policy_loss,
    tis_policy_loss,
    gae,
    grpo_advantages,
    kl_penalty,
    masked_mean,
    masked_whiten,
    policy_loss,
    value_loss,
)

LN = math.log


def close(actual, expected, atol=1e-5):
    actual = torch.as_tensor(actual, dtype=torch.float32)
    torch.testing.assert_close(actual, torch.tensor(expected), atol=atol, rtol=0)


# --- GRPO advantages -------------------------------------------------------------------------


def test_grpo_advantages_use_population_std_and_zero_constant_groups():
    # Group 0 = [1, 0, 0]: mean 1/3; deviations 2/3, -1/3, -1/3;
    # population var = (4/9 + 1/9 + 1/9) / 3 = 2/9, std = sqrt(2)/3.
    # A = (2/3) / (sqrt(2)/3) = sqrt(2) = 1.41421; (-1/3) / (sqrt(2)/3) = -1/sqrt(2) = -0.70711.
    # (Sample std sqrt(1/3) would give 1.1547 instead.) Group 1 = [2, 2, 2] is constant -> zeros.
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0], [2.0, 2.0, 2.0]]))
    close(adv, [[1.41421, -0.70711, -0.70711], [0.0, 0.0, 0.0]])
    assert (adv[1] == 0).all()


def test_grpo_advantages_without_std_only_centre():
    adv = grpo_advantages(torch.tensor([[1.0, 0.0, 0.0]]), normalize_std=False)
    close(adv, [[2 / 3, -1 / 3, -1 / 3]])


def test_grpo_advantages_accept_ragged_groups_and_return_flat():
    # [1, 0]: mean 0.5, population std 0.5 -> [+1, -1]; [5] alone -> 0.
    close(grpo_advantages([[1.0, 0.0], [5.0]]), [1.0, -1.0, 0.0])


# --- policy loss -----------------------------------------------------------------------------


def _five_tokens():
    """Five one-token sequences (B=5, T=1), clip_eps = 0.2, old logprob -1 everywhere.

    token  ratio  A    ratio*A  clip(ratio)*A  min    loss   d loss / d logp
    0      1.5    +1   1.5      1.2            1.2    -1.2   0 (clipped)
    1      1.5    -1   -1.5     -1.2           -1.5   +1.5   -A*ratio = +1.5
    2      0.5    +1   0.5      0.8            0.5    -0.5   -0.5
    3      0.5    -1   -0.5     -0.8           -0.8   +0.8   0 (clipped)
    4      1.1    +2   2.2      2.2            2.2    -2.2   -2.2 (inside the range)
    """
    ratios = torch.tensor([1.5, 1.5, 0.5, 0.5, 1.1])
    old = torch.full((5, 1), -1.0)
    logp = (old + torch.log(ratios)[:, None]).requires_grad_(True)
    return logp, old, torch.tensor([1.0, -1.0, 1.0, -1.0, 2.0]), torch.ones(5, 1)


def test_policy_loss_clips_both_signs_and_zeroes_clipped_gradients():
    logp, old, adv, mask = _five_tokens()
    loss, metrics = policy_loss(logp, old, adv, mask, clip_eps=0.2)
    # token-mean: (-1.2 + 1.5 - 0.5 + 0.8 - 2.2) / 5 = -1.6 / 5 = -0.32
    close(loss, -0.32)
    loss.backward()
    close(logp.grad[:, 0], [0.0, 0.3, -0.1, 0.0, -0.44])  # per-token grads / 5
    assert logp.grad[0, 0] == 0 and logp.grad[3, 0] == 0
    close(metrics["clip_frac"], 0.4)  # tokens 0 and 3
    close(metrics["ratio_mean"], 1.02)  # (1.5 + 1.5 + 0.5 + 0.5 + 1.1) / 5
    # approx_kl = mean(old - new) = -(2 ln 1.5 + 2 ln 0.5 + ln 1.1) / 5
    close(metrics["approx_kl"], -(2 * LN(1.5) + 2 * LN(0.5) + LN(1.1)) / 5)


def test_policy_loss_clip_higher_widens_only_the_upper_bound():
    logp, old, adv, mask = _five_tokens()
    # With clip_eps_high = 0.6, token 0 (ratio 1.5, A=+1) is no longer clipped: loss -1.5.
    loss, metrics = policy_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.6)
    close(loss, (-1.5 + 1.5 - 0.5 + 0.8 - 2.2) / 5)
    close(metrics["clip_frac"], 0.2)


def test_token_mean_and_seq_mean_differ_on_unequal_lengths():
    # ratio = 1, so each token's loss is -A. Row 0: one token with A=3. Row 1: three tokens with A=1.
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([3.0, 1.0])
    token_mean, _ = policy_loss(logp, logp, adv, mask, 0.2, loss_agg="token-mean")
    seq_mean, _ = policy_loss(logp, logp, adv, mask, 0.2, loss_agg="seq-mean")
    close(token_mean, (-3 - 1 - 1 - 1) / 4)  # -1.5: every token weighs the same
    close(seq_mean, (-3 + -1) / 2)  # -2.0: every sequence weighs the same
    with pytest.raises(ValueError, match="loss_agg"):
        policy_loss(logp, logp, adv, mask, 0.2, loss_agg="sum")


def test_policy_loss_names_shapes_on_mismatch():
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(2, 4\)"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2, 4), 0.2)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(5), torch.ones(2, 3), 0.2)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean"])
def test_micro_batch_accumulation_matches_full_batch_gradient(loss_agg):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 7)
    x = torch.randn(4, 5, 4)
    targets = torch.randint(0, 7, (4, 5))
    lengths = torch.tensor([5, 1, 1, 4])  # micro-batches hold 6 and 5 tokens
    mask = (torch.arange(5)[None] < lengths[:, None]).float()
    adv = torch.tensor([1.0, -2.0, 0.5, 1.5])
    with torch.no_grad():
        old = token_logprobs(model(x), targets) - 0.1 * torch.randn(4, 5)

    def loss_on(rows, denominator):
        logp = token_logprobs(model(x[rows]), targets[rows])
        return policy_loss(logp, old[rows], adv[rows], mask[rows], 0.2, loss_agg, denominator)[0]

    def grads(losses):
        model.zero_grad()
        for loss in losses:
            loss.backward()
        return [p.grad.clone() for p in model.parameters()]

    full = grads([loss_on(slice(0, 4), None)])
    total = mask.sum() if loss_agg == "token-mean" else 4
    micro = grads([loss_on(slice(0, 2), total), loss_on(slice(2, 4), total)])
    for f, m in zip(full, micro):
        torch.testing.assert_close(f, m)
    # Averaging micro-batch means (no shared denominator) is *not* the full-batch gradient.
    naive = grads([loss_on(slice(0, 2), None) / 2, loss_on(slice(2, 4), None) / 2])
    if loss_agg == "token-mean":
        assert not torch.allclose(full[0], naive[0])


# --- KL --------------------------------------------------------------------------------------


def test_kl_estimators_on_hand_values():
    # Token 0: logp = 0, ref = ln 2 -> log_r = ln 2, r = 2.
    #   k1 = -ln 2 = -0.693147; k2 = (ln 2)^2 / 2 = 0.240227; k3 = (2 - 1) - ln 2 = 0.306853.
    # Token 1: logp = 0, ref = -ln 2 -> r = 1/2: k3 = (0.5 - 1) + ln 2 = 0.193147.
    # Token 2 is masked -> 0 whatever the inputs.
    logp = torch.tensor([[0.0, 0.0, 5.0]])
    ref = torch.tensor([[LN(2), -LN(2), -5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    close(kl_penalty(logp, ref, mask, "k3"), [[0.306853, 0.193147, 0.0]])
    close(kl_penalty(logp, ref, mask, "k1"), [[-0.693147, 0.693147, 0.0]])
    close(kl_penalty(logp, ref, mask, "k2"), [[0.240227, 0.240227, 0.0]])
    with pytest.raises(ValueError, match="k4"):
        kl_penalty(logp, ref, mask, "k4")


# --- GAE -------------------------------------------------------------------------------------

REWARDS = [[0.0, 0.0, 1.0]]
VALUES = [[0.5, 0.6, 0.7]]


def test_gae_gamma_one_lambda_one_is_return_minus_value():
    # gamma = lam = 1: A_t = (sum of future rewards) - V_t = 1 - V_t; returns = 1 everywhere.
    adv, ret = gae(torch.tensor(REWARDS), torch.tensor(VALUES), torch.ones(1, 3), 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_gae_with_discount_and_lambda():
    # gamma = lam = 0.5 (gamma * lam = 0.25):
    #   delta_2 = 1 + 0.5*0   - 0.7 =  0.3    A_2 = 0.3
    #   delta_1 = 0 + 0.5*0.7 - 0.6 = -0.25   A_1 = -0.25 + 0.25*0.3    = -0.175
    #   delta_0 = 0 + 0.5*0.6 - 0.5 = -0.2    A_0 = -0.2  + 0.25*-0.175 = -0.24375
    # returns = A + V = [0.25625, 0.425, 1.0]
    adv, ret = gae(torch.tensor(REWARDS), torch.tensor(VALUES), torch.ones(1, 3), 0.5, 0.5)
    close(adv, [[-0.24375, -0.175, 0.3]])
    close(ret, [[0.25625, 0.425, 1.0]])


def test_gae_bootstraps_zero_after_last_valid_token_under_padding():
    # Row 0 as above (gamma = lam = 1), padded to T = 4 with a garbage value 9 on the pad.
    # Row 1 has length 2: rewards [0, 2], values [1.0, 0.5], then pads with value 9.
    #   A_1 = 2 + 0 - 0.5 = 1.5 (bootstrap 0, not 9); A_0 = 0 + 0.5 - 1.0 + 1.5 = 1.0.
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0], [1.0, 0.5, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    close(adv, [[0.5, 0.4, 0.3, 0.0], [1.0, 1.5, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 0.0, 0.0]])


def test_gae_skips_masked_tokens_inside_a_response():
    # mask [1, 0, 1] (e.g. a tool-output token in the middle), gamma = lam = 0.5:
    #   A_2 = 1 - 0.7 = 0.3; token 1 is skipped, so token 0's next state is token 2:
    #   delta_0 = 0 + 0.5*0.7 - 0.5 = -0.15; A_0 = -0.15 + 0.25*0.3 = -0.075.
    values, mask = torch.tensor([[0.5, 9.0, 0.7]]), torch.tensor([[1.0, 0.0, 1.0]])
    adv, _ = gae(torch.tensor(REWARDS), values, mask, 0.5, 0.5)
    close(adv, [[-0.075, 0.0, 0.3]])


def test_gae_rejects_reward_on_padding():
    with pytest.raises(ValueError, match="masked"):
        gae(torch.tensor([[0.0, 1.0]]), torch.zeros(1, 2), torch.tensor([[1.0, 0.0]]), 1.0, 1.0)


# --- value loss ------------------------------------------------------------------------------


def test_clipped_value_loss():
    # clip = 0.2, old value 1.0 on every token.
    # token 0: V=1.5, R=2: V_clip=1.2; (1.5-2)^2=0.25 < (1.2-2)^2=0.64 -> 0.5*0.64 = 0.32, grad 0.
    # token 1: V=1.1, R=2: inside the clip; 0.5*(0.9)^2 = 0.405, grad V-R = -0.9.
    # token 2: V=0.5, R=2: V_clip=0.8; (1.5)^2=2.25 > (1.2)^2=1.44 -> 1.125, grad -1.5.
    # token 3: padding (garbage values) -> ignored.
    # token-mean = (0.32 + 0.405 + 1.125) / 3 = 0.616667; grads / 3 = [0, -0.3, -0.5].
    values = torch.tensor([[1.5, 1.1, 0.5, 100.0]], requires_grad=True)
    old = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 2.0, -50.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.2)
    close(loss, 0.616667)
    loss.backward()
    close(values.grad, [[0.0, -0.3, -0.5, 0.0]])
    close(metrics["vf_clip_frac"], 1 / 3)


# --- helpers ---------------------------------------------------------------------------------


def test_masked_mean_and_whiten_ignore_padding():
    x = torch.tensor([[1.0, 3.0, 100.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    close(masked_mean(x, mask), 2.0)
    # mean 2, population var 1 -> [-1, 1], padding stays 0.
    close(masked_whiten(x, mask), [[-1.0, 1.0, 0.0]])
    close(masked_mean(x, torch.zeros_like(mask)), 0.0)  # empty mask: 0, not NaN


# --- token log-probs -------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_token_logprobs_match_categorical_values_and_gradients(temperature):
    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 5))
    weights = torch.randn(2, 5, dtype=torch.float64)
    ours = token_logprobs(logits, targets, temperature, chunk_size=3)  # several chunks, ragged tail
    ref = torch.distributions.Categorical(logits=logits / temperature).log_prob(targets)
    torch.testing.assert_close(ours.double(), ref, atol=1e-6, rtol=0)
    (g_ours,) = torch.autograd.grad((ours.double() * weights).sum(), logits)
    (g_ref,) = torch.autograd.grad((ref * weights).sum(), logits)
    torch.testing.assert_close(g_ours, g_ref, atol=1e-6, rtol=0)


def test_token_logprobs_keep_bf16_grad_dtype_and_check_inputs():
    logits = torch.randn(1, 2, 4).bfloat16().requires_grad_(True)
    out = token_logprobs(logits, torch.tensor([[0, 3]]))
    assert out.dtype == torch.float32
    out.sum().backward()
    assert logits.grad.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="out of range"):
        token_logprobs(logits, torch.tensor([[0, 4]]))
    with pytest.raises(ValueError, match=r"\(1, 2, 4\).*\(2, 2\)"):
        token_logprobs(logits, torch.zeros(2, 2, dtype=torch.long))


def test_decoupled_ppo_weights_by_prox_over_behaviour_and_clips_around_prox():
    # one sequence, three tokens; advantages +1
    lp = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.9)]], requires_grad=True)
    prox = torch.tensor([[math.log(0.4), math.log(0.3), math.log(0.6)]])
    behav = torch.tensor([[math.log(0.2), math.log(0.6), math.log(0.6)]])
    mask = torch.ones(1, 3)
    loss, m = decoupled_policy_loss(lp, prox, behav, torch.tensor([1.0]), mask, clip_eps=0.2, is_cap=1.5)
    # r = pi/prox = 1.25, 1.0, 1.5; w = min(prox/behav, 1.5) = min(2, 1.5), 0.5, 1.0
    # per token: -w * min(r, clip(r, .8, 1.2)) = -1.5*1.2, -0.5*1.0, -1.0*1.2
    assert loss.item() == pytest.approx(-(1.5 * 1.2 + 0.5 * 1.0 + 1.0 * 1.2) / 3)
    assert m["clip_frac"] == pytest.approx(2 / 3) and m["is_capped_frac"] == pytest.approx(1 / 3)
    assert m["is_weight_max"] == pytest.approx(2.0) and m["is_weight_min"] == pytest.approx(0.5)
    assert m["is_weight_mean"] == pytest.approx((2.0 + 0.5 + 1.0) / 3)
    loss.backward()
    # clipped tokens get no gradient; the middle one: d/dlp of -0.5 * exp(lp - prox) = -0.5 * r / 3
    assert lp.grad[0, 0].item() == 0.0 and lp.grad[0, 2].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-0.5 / 3)


def test_decoupled_ppo_with_fresh_samples_is_ppo():
    torch.manual_seed(0)
    lp = torch.randn(2, 4, requires_grad=True)
    old = (lp + 0.1 * torch.randn(2, 4)).detach()
    adv, mask = torch.tensor([1.0, -0.5]), torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float)
    a, _ = decoupled_policy_loss(lp, old, old, adv, mask)
    b, _ = policy_loss(lp, old, adv, mask)
    assert a.item() == pytest.approx(b.item())


def test_truncated_is_weights_the_policy_gradient_per_token():
    lp = torch.tensor([[math.log(0.5), math.log(0.1)]], requires_grad=True)
    behav = torch.tensor([[math.log(0.1), math.log(0.2)]])
    loss, m = tis_policy_loss(lp, behav, torch.tensor([2.0]), torch.ones(1, 2), is_cap=3.0)
    # rho = min(5, 3) = 3, min(0.5, 3) = 0.5; loss = -(3 * 2 * lp0 + 0.5 * 2 * lp1) / 2
    assert loss.item() == pytest.approx(-(6 * math.log(0.5) + 1.0 * math.log(0.1)) / 2)
    loss.backward()
    assert lp.grad[0].tolist() == pytest.approx([-3.0, -0.5])
    assert m["clip_frac"] == pytest.approx(0.5) and m["is_weight_max"] == pytest.approx(5.0)
    assert m["is_weight_std"] == pytest.approx(2.25)


@pytest.mark.parametrize("with_bias", [False, True])
def test_head_logprobs_and_entropy_match_the_full_logits_with_gradients(with_bias):
    """The chunked head never builds [N, V] logits, yet gives the same log-probs, entropies and
    gradients (to the hidden states, the head's weight and bias) as log_softmax over full logits."""
    torch.manual_seed(0)
    hidden = torch.randn(2, 5, 6, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 6, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets = torch.randint(0, 11, (2, 5))
    # 3 rows per chunk: several chunks and a ragged tail
    logp, ent = head_logprobs(hidden, weight, targets, 0.7, bias=bias, chunk_elements=33)
    logits = (hidden @ weight.t() + (bias if with_bias else 0.0)) / 0.7
    ref_all = torch.log_softmax(logits, -1)
    ref_logp = ref_all.gather(-1, targets[..., None]).squeeze(-1)
    ref_ent = -(ref_all.exp() * ref_all).sum(-1)
    torch.testing.assert_close(logp, ref_logp, atol=1e-10, rtol=0)
    torch.testing.assert_close(ent, ref_ent, atol=1e-10, rtol=0)
    w1, w2 = torch.randn(2, 5, dtype=torch.float64), torch.randn(2, 5, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    ours = torch.autograd.grad((logp * w1 + ent * w2).sum(), inputs)
    ref = torch.autograd.grad((ref_logp * w1 + ref_ent * w2).sum(), inputs)
    for a, b in zip(ours, ref):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="out of range"):
        head_logprobs(hidden, weight, torch.full((2, 5), 11))

"""Pure scheduling policies: latency model, dispatch (Algorithm 2), order (LPT), balance
(Algorithm 1), elastic rule. Small cases with answers worked by hand."""

import math

import pytest

from streamrl.policies.balance import balance_cross_dc, balance_single_dc
from streamrl.policies.dispatch import make_dispatch_policy, skewness_split
from streamrl.policies.elastic import ElasticRule, should_add_instance
from streamrl.policies.latency import H800_QWEN7B_VLLM, LatencyModel, load_profile, save_profile
from streamrl.policies.order import make_order_policy

FLAT = LatencyModel(((1, 10.0), (2, 10.0)))  # 10 ms/token at any batch size


def test_latency_interpolates_between_paper_points():
    assert H800_QWEN7B_VLLM.ms_per_token(1) == 8.4
    assert H800_QWEN7B_VLLM.ms_per_token(512) == 36.9
    assert H800_QWEN7B_VLLM.ms_per_token(192) == pytest.approx((15.3 + 21.2) / 2)
    assert H800_QWEN7B_VLLM.ms_per_token(0.5) == 8.4  # clamped below
    assert H800_QWEN7B_VLLM.ms_per_token(768) == pytest.approx(36.9 + (36.9 - 21.2))  # last slope


def test_pool_latency_is_ptl_times_length_times_waves():
    # 10 prompts of mean 1000 tokens, batch cap 4 -> BS 4, ceil(10/4) = 3 waves at 8.9 ms/token.
    assert H800_QWEN7B_VLLM.pool_latency_s(10, 1000, 4) == pytest.approx(0.0089 * 1000 * 3)
    assert H800_QWEN7B_VLLM.pool_latency_s(0, 1000) == 0.0


def test_profile_file_round_trips(tmp_path):
    model = LatencyModel(((1, 2.0), (8, 3.0)), "transformers", "tiny", "cpu", {"train_tokens_per_s": 900.0})
    save_profile(model, tmp_path / "p.json")
    back = load_profile(tmp_path / "p.json")
    assert back == model and back.extra["train_tokens_per_s"] == 900.0


def test_latency_rejects_bad_points():
    with pytest.raises(ValueError, match="duplicate"):
        LatencyModel(((1, 2.0), (1, 3.0)))
    with pytest.raises(ValueError, match="empty"):
        LatencyModel(())


def test_factory_rejects_unknown_names():
    with pytest.raises(ValueError, match="unknown dispatch policy 'fastest'"):
        make_dispatch_policy("fastest")
    with pytest.raises(ValueError, match="unknown order policy"):
        make_order_policy("shortest")


def test_round_robin_and_least_loaded():
    assert make_dispatch_policy("round-robin").assign([5, 5, 5, 5, 5], 2) == [0, 1, 0, 1, 0]
    # least-loaded by predicted tokens: 100 -> 0, 10 -> 1, 10 -> 1 (load 10 < 100), 50 -> 1 (20 < 100)
    assert make_dispatch_policy("least-loaded").assign([100, 10, 10, 50], 2) == [0, 1, 1, 1]


def test_random_dispatch_is_seeded():
    a = make_dispatch_policy("random", seed=3).assign([1] * 20, 4)
    assert a == make_dispatch_policy("random", seed=3).assign([1] * 20, 4)
    assert set(a) <= {0, 1, 2, 3}


def test_skewness_split_hand_worked():
    # 10 requests, alpha 0.2 -> 2 long (100 tokens), 8 regular (10 tokens), 4 instances, BS 1.
    # k=1: long 2*1.0=2.0; k=2: long 1.0, regular ceil(8/2)*0.1=0.4; k=3: long 1.0, regular 0.8.
    s = skewness_split(10, 4, 100, 10, FLAT, alpha=0.2, max_batch_size=1)
    assert (s.long_instances, s.long_requests) == (2, 2)
    assert s.cost_s == pytest.approx(1.0)


def test_skewness_split_max_and_sum_disagree():
    # 9 requests -> 2 long (100 tokens) + 7 regular (30 tokens), 3 instances, BS 1, 10 ms/token.
    # k=1: long 2.0, regular ceil(7/2)*0.3 = 1.2 -> max 2.0, sum 3.2
    # k=2: long 1.0, regular 7*0.3 = 2.1       -> max 2.1, sum 3.1
    by_max = skewness_split(9, 3, 100, 30, FLAT, max_batch_size=1, combine="max")
    by_sum = skewness_split(9, 3, 100, 30, FLAT, max_batch_size=1, combine="sum")
    assert by_max.long_instances == 1 and by_max.cost_s == pytest.approx(2.0)
    assert by_sum.long_instances == 2 and by_sum.cost_s == pytest.approx(3.1)
    assert max(by_sum.long_latency_s, by_sum.regular_latency_s) > by_max.cost_s  # sum's makespan is worse


def test_skewness_aware_puts_longest_on_the_long_pool():
    policy = make_dispatch_policy("skewness-aware", latency=FLAT, max_batch_size=1)
    pred = [10, 300, 10, 10, 200, 10, 10, 10, 10, 10]
    out = policy.assign(pred, 4)
    k = policy.last_split.long_instances
    assert k == 2
    assert {out[1], out[4]} == {0, 1}  # the two longest, one per long-tail instance
    assert all(out[i] >= k for i in range(10) if i not in (1, 4))


def test_lpt_orders_longest_first_stably():
    assert make_order_policy("lpt").order([3, 9, 3, 7]) == [1, 3, 0, 2]
    assert make_order_policy("fifo").order([3, 9, 3, 7]) == [0, 1, 2, 3]


def test_balance_single_dc_picks_min_max():
    # P_gen(x) = 60/x, P_train(y) = 30/y, n = 9: x=6,y=3 gives max(10, 10) = 10.
    b = balance_single_dc(9, lambda x: 60 / x, lambda y: 30 / y)
    assert (b.gen_devices, b.train_devices) == (6, 3)
    assert b.t_iter == pytest.approx(10)


def test_balance_single_dc_respects_units_and_infeasible():
    # training needs >= 4 devices (inf below), in units of 4; generation in units of 2.
    b = balance_single_dc(12, lambda x: 48 / x, lambda y: math.inf if y < 4 else 24 / y, gen_unit=2, train_unit=4)
    assert b.gen_devices % 2 == 0 and b.train_devices % 4 == 0 and b.train_devices >= 4
    assert (b.gen_devices, b.train_devices) == (8, 4)
    with pytest.raises(ValueError, match="no feasible split"):
        balance_single_dc(3, lambda x: 1.0, lambda y: math.inf)


def test_balance_cross_dc_shrinks_faster_side():
    # generation faster: P_gen(32) = 1 < P_train(16) = 4 -> shrink gen to k with 32/k = 4 -> k = 8.
    b = balance_cross_dc(32, 16, lambda k: 32 / k, lambda k: 64 / k)
    assert (b.gen_devices, b.train_devices) == (8, 16)
    # training faster: P_gen(8) = 8 > P_train(16) = 4 -> shrink training to k with 64/k = 8 -> 8.
    b = balance_cross_dc(8, 16, lambda k: 64 / k, lambda k: 64 / k)
    assert (b.gen_devices, b.train_devices) == (8, 8)


def test_elastic_rule_adds_only_when_gap_covers_one_instance():
    assert should_add_instance(t_gen=100, t_train=80, t_gen_plus_one=90)  # delta 20 >= delta' 10
    assert not should_add_instance(t_gen=100, t_train=95, t_gen_plus_one=90)  # 5 < 10
    assert not should_add_instance(t_gen=80, t_train=100, t_gen_plus_one=70)  # training is slower
    rule = ElasticRule(max_instances=3)
    assert rule.decide(2, 100, 80, 90) == 1
    assert rule.decide(3, 100, 80, 90) == 0  # at the cap


def test_elastic_smoothing_ignores_one_spike():
    rule = ElasticRule(max_instances=10, smoothing=0.9)
    assert rule.decide(2, 100, 100, 90) == 0
    assert rule.decide(2, 130, 100, 120) == 0  # smoothed delta 3 < 10

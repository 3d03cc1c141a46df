"""Pure scheduling policies: latency model, dispatch (Algorithm 2), order (LPT), balance
(Algorithm 1), elastic rule. Small cases with answers worked by hand."""

import math

import pytest

from streamrl.scheduling.balance import balance_cross_dc, balance_single_dc
from streamrl.scheduling.dispatch import make_dispatch_policy, skewness_split
from streamrl.scheduling.elastic import ElasticRule, should_add_instance
from streamrl.scheduling.latency import H800_QWEN7B_VLLM, LatencyModel, load_profile, save_profile
from streamrl.scheduling.order import make_order_policy

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


def test_lpt_priorities_reproduce_the_lpt_order_and_fifo_ties_everything():
    lengths = [3, 9, 3, 7]
    prio = make_order_policy("lpt").priorities(lengths)
    # an engine admitting larger priority first, ties in arrival order, follows order() exactly
    assert sorted(range(4), key=lambda i: (-prio[i], i)) == make_order_policy("lpt").order(lengths)
    assert make_order_policy("fifo").priorities(lengths) == [0.0] * 4
    with pytest.raises(ValueError, match="nan"):
        make_order_policy("lpt").priorities([1.0, float("nan")])


def slot_makespan(order, lengths, slots=2):
    """Makespan of admitting ``order`` onto ``slots`` identical slots, each job to the first free one."""
    free = [0.0] * slots
    for i in order:
        k = free.index(min(free))
        free[k] += lengths[i]
    return max(free)


def test_lpt_admission_finishes_sooner_than_fifo_on_two_slots():
    # two batch slots, jobs 2,2,4 (time units): FIFO runs 2|2 then 4 -> makespan 6; LPT 4|2,2 -> 4.
    lengths = [2, 2, 4]
    assert slot_makespan(make_order_policy("fifo").order(lengths), lengths) == 6
    assert slot_makespan(make_order_policy("lpt").order(lengths), lengths) == 4


def test_hedged_lpt_starts_the_predicted_head_first_and_keeps_arrival_order_behind_it():
    # predictions for 10 requests; head 0.2 -> the two predicted longest (idx 4: 90, idx 7: 80) first
    pred = [5, 30, 10, 20, 90, 1, 40, 80, 2, 3]
    hedged = make_order_policy("lpt-head", head=0.2)
    assert hedged.order(pred) == [4, 7, 0, 1, 2, 3, 5, 6, 8, 9]
    prio = hedged.priorities(pred)
    assert sorted(range(10), key=lambda i: (-prio[i], i)) == hedged.order(pred)  # what the engines admit
    # Why: two slots, true lengths; the ranker missed request 2 (truly 12, predicted shortest).
    # Full LPT admits it last and it ends the batch at 15; hedged starts it in arrival order: 13.
    true = [4, 1, 12, 1, 1]
    guess = [3, 2, 0, 1, 1]
    assert slot_makespan(make_order_policy("lpt").order(guess), true) == 15
    assert slot_makespan(make_order_policy("lpt-head", head=0.2).order(guess), true) == 13
    with pytest.raises(ValueError, match="head=0"):
        make_order_policy("lpt-head", head=0.0)


def test_skewness_aware_uses_history_quantiles_not_the_predictions():
    # 5 requests, alpha 0.2 -> 1 long. History P90 = 1000, P50 = 10 (FLAT 10 ms/token, BS 1), 3 instances:
    # k=1: long 1 x 1000 x 0.01 = 10.0 s, regular ceil(4/2) x 10 x 0.01 = 0.2 -> 10.0
    # k=2: long 10.0, regular 4 x 0.1 = 0.4 -> 10.0; tie -> k=1 kept.
    # From the predictions instead (P90 of [1..5] = 4.6) the long pool would be 0.046 s.
    history = [10] * 9 + [1000] * 2
    policy = make_dispatch_policy("skewness-aware", latency=FLAT, max_batch_size=1, history=history)
    out = policy.assign([1, 5, 2, 4, 3], 3)
    assert policy.last_split.long_instances == 1
    assert policy.last_split.long_latency_s == pytest.approx(10.0)
    assert policy.last_split.regular_latency_s == pytest.approx(0.2)
    assert out[1] == 0 and all(k >= 1 for i, k in enumerate(out) if i != 1)  # the longest predicted -> long pool
    assert sorted(out[i] for i in (0, 2, 3, 4)) == [1, 1, 2, 2]  # regular pool balanced by predicted load


def test_rebalance_moves_queued_requests_to_an_idle_instance_hand_worked():
    from streamrl.scheduling.rebalance import plan_moves, remaining_time_s

    # 10 ms/token, batch 2. a: 4 x 100 tokens (a1, a2 running; a3, a4 queued): T = 0.01*max(400/2, 100) = 2.0
    assert remaining_time_s([100] * 4, FLAT, 2) == pytest.approx(2.0)
    unfinished = {"a": [("a1", 100), ("a2", 100), ("a3", 100), ("a4", 100)], "b": []}
    moves = plan_moves(unfinished, {"a": ["a3", "a4"]}, FLAT, max_batch_size=2, threshold=0.25)
    # move a3: a 1.5, b 1.0 (gap 0.5 > 0.25*1.5); move a4: a 1.0, b 1.0 -> balanced
    assert [(m.request_id, m.src, m.dst) for m in moves] == [("a3", "a", "b"), ("a4", "a", "b")]
    # work stealing: b has one free slot, so it takes one request this round; a none, b none: nothing
    one = plan_moves(unfinished, {"a": ["a3", "a4"]}, FLAT, max_batch_size=2, threshold=0.25, room={"a": 0, "b": 1})
    assert [(m.request_id, m.dst) for m in one] == [("a3", "b")]
    assert plan_moves(unfinished, {"a": ["a3", "a4"]}, FLAT, max_batch_size=2, room={"a": 0, "b": 0}) == []


def test_rebalance_picks_the_move_that_most_shortens_the_makespan():
    from streamrl.scheduling.rebalance import plan_moves

    # a: running 50, 50; queued 120, 30, 30 -> T_a = 0.01*max(280/2, 120) = 1.4; b idle.
    # moving 120: max(0.01*max(160/2, 50), 1.2) = 1.2; moving a 30: max(1.25, 0.3) = 1.25 -> 120 goes.
    # then b (1.2) > a (0.8) by 0.4 > 0.3, but moving 120 back gives 1.4: stop.
    unfinished = {"a": [("r1", 50), ("r2", 50), ("q1", 120), ("q2", 30), ("q3", 30)], "b": []}
    moves = plan_moves(unfinished, {"a": ["q2", "q1", "q3"]}, FLAT, max_batch_size=2, threshold=0.25)
    assert [(m.request_id, m.dst) for m in moves] == [("q1", "b")]


def test_rebalance_leaves_small_gaps_and_running_requests_alone():
    from streamrl.scheduling.rebalance import plan_moves

    # a 1.5 vs b 1.0: moving a 100 would make b 1.5 -> no gain, no move
    near = {"a": [("a1", 100), ("a2", 100), ("a3", 100)], "b": [("b1", 100), ("b2", 100)]}
    assert plan_moves(near, {"a": ["a3"]}, FLAT, max_batch_size=2) == []
    # a has far more work but nothing queued: nothing may move
    assert plan_moves({"a": [("a1", 500)] * 1, "b": []}, {"a": []}, FLAT, max_batch_size=2) == []
    # below the threshold: no move even if one would help a little
    assert plan_moves(near, {"a": ["a3"]}, FLAT, max_batch_size=2, threshold=0.5) == []


def test_rebalance_round_steals_into_free_slots_from_progress_hand_worked():
    from streamrl.scheduling.rebalance import Unfinished, plan_round

    def u(rid, predicted, generated=0, started=False, may_move=True):
        return Unfinished(rid, predicted, generated, 200, started, may_move)

    # Batch 2, 10 ms/token. a runs r1 (predicted 100, 40 done: 60 left) and r2 (past its prediction
    # of 50 at 60: the recent lengths that got further overshoot by a median 90 - 60 = 30) and
    # queues q1, q2 (100 each); b runs one request with 20 left, so it has one free slot.
    a = [u("r1", 100, 40, True), u("r2", 50, 60, True), u("q1", 100), u("q2", 100)]
    b = [u("b1", 30, 10, True, may_move=False)]
    # T_a = 0.01 * max((60 + 30 + 100 + 100) / 2, 100) = 1.45, T_b = 0.01 * 20 = 0.2. Into b's one
    # free slot: r1 (60 left) gives max(1.15, 0.6), r2 (30) max(1.30, 0.3), q1 (100) max(1.0, 1.0).
    moves = plan_round({"a": a, "b": b}, FLAT, max_batch_size=2, threshold=0.25, recent=[80, 90, 120])
    assert [(m.request_id, m.src, m.dst, m.predicted_len) for m in moves] == [("q1", "a", "b", 100.0)]
    # with q1 and q2 pinned, the running r1 goes: its remaining 60 is what moves
    pinned = [a[0], a[1], u("q1", 100, may_move=False), u("q2", 100, may_move=False)]
    moves = plan_round({"a": pinned, "b": b}, FLAT, max_batch_size=2, threshold=0.25, recent=[80, 90, 120])
    assert [(m.request_id, m.predicted_len) for m in moves] == [("r1", 60.0)]
    # every instance holds a full batch: nothing to steal into
    assert plan_round({"a": a, "b": b + [u("b2", 30, 0, True)]}, FLAT, max_batch_size=2) == []
    # a running request about to finish is not worth stopping; not-started ones still move
    nearly = [u("r1", 100, 95, True), u("r2", 100, 96, True), u("q1", 100), u("q2", 100)]
    assert [m.request_id for m in plan_round({"a": nearly, "b": []}, FLAT, max_batch_size=2)] == ["q1"]
    # the gap is below the threshold
    even = {"a": [u("q1", 100), u("q2", 100)], "b": [u("b1", 90, 0, True, False)]}
    assert plan_round(even, FLAT, max_batch_size=2, threshold=0.25) == []


def test_rebalance_rejects_bad_input_naming_the_value():
    from streamrl.scheduling.rebalance import plan_moves

    with pytest.raises(ValueError, match="threshold=1.5"):
        plan_moves({"a": []}, {}, FLAT, threshold=1.5)
    with pytest.raises(ValueError, match="'x'.*not unfinished"):
        plan_moves({"a": [("r", 1.0)], "b": []}, {"a": ["x"]}, FLAT)
    with pytest.raises(ValueError, match="-3"):
        plan_moves({"a": [("r", -3.0)], "b": []}, {}, FLAT)


def test_instance_makespan_follows_the_running_count_hand_worked():
    from streamrl.scheduling.dispatch import instance_makespan_s

    # PTL(1) = 1 s, PTL(2) = 1.5 s. Lengths 3 and 2 together: 2 steps at 1.5 s, then 1 at 1 s.
    lat = LatencyModel(((1, 1000.0), (2, 1500.0)))
    assert instance_makespan_s([2, 3], lat, 2) == pytest.approx(4.0)
    assert instance_makespan_s([2, 3], lat, 1) == pytest.approx(5.0)  # one at a time: 3 + 2 steps at 1 s
    # LPT admission with a batch of 1 and three requests: order does not change the sum ...
    assert instance_makespan_s([1, 5, 2], lat, 1) == pytest.approx(8.0)
    # ... but with a batch of 2 the longest starts first: 5 runs beside 2 then 1 (2 + 1 = 3 steps
    # at 1.5 s), then alone for 2 steps at 1 s.
    assert instance_makespan_s([1, 5, 2], lat, 2) == pytest.approx(6.5)
    assert instance_makespan_s([], lat, 2) == 0.0


def test_skewness_search_isolates_the_tail_when_big_batches_are_slow():
    from streamrl.scheduling.dispatch import instance_makespan_s

    # PTL grows 4x from 1 to 32 running: one 100-token request among twenty 10-token ones on two
    # instances. Alone, it takes 100 x PTL(1); in a big batch much longer. The paper's fixed 20 %
    # split puts 4 requests beside it; the search finds the split that leaves it alone.
    lat = LatencyModel(((1, 1.0), (32, 4.0)))
    lengths = [10.0] * 20 + [100.0]
    search = make_dispatch_policy("skewness-search", latency=lat, max_batch_size=32, history=lengths)
    out = search.assign(lengths, 2)
    tail_inst = out[20]
    assert [i for i, x in enumerate(out) if x == tail_inst] == [20]
    paper = make_dispatch_policy("skewness-aware", latency=lat, max_batch_size=32, history=lengths).assign(lengths, 2)

    def makespan(assign):
        return max(instance_makespan_s([lengths[i] for i, x in enumerate(assign) if x == k], lat, 32) for k in set(assign))

    assert makespan(out) < makespan(paper)
    assert search.last_split.predicted_s == pytest.approx(makespan(out))
    # Only the order of the predictions matters: a monotone transform gives the same assignment.
    assert make_dispatch_policy("skewness-search", latency=lat, max_batch_size=32, history=lengths).assign(
        [math.log(x) for x in lengths], 2) == out


def test_skewness_search_rejects_bad_alphas():
    with pytest.raises(ValueError, match="alphas"):
        make_dispatch_policy("skewness-search", alphas=(0.2, 1.5))


def test_instance_makespan_pays_for_context_when_the_profile_has_a_kv_cost():
    from streamrl.scheduling.dispatch import instance_makespan_s

    # PTL 1 s at any batch size, 0.1 s per context token held; prompts of 2 tokens.
    lat = LatencyModel(((1, 1000.0), (2, 1000.0)), extra={"kv_ms_per_token": 100.0})
    assert lat.kv_ms_per_token == 100.0
    # One request of 3 tokens: its steps hold 2, 3, 4 context tokens -> 3 x 1 s + 0.1 x 9.
    assert instance_makespan_s([3], lat, 1, prompt_len=2) == pytest.approx(3.9)
    # Lengths 3 and 1 together: step 1 holds 2 + 2 tokens (1.4 s); then the long one alone with
    # 3 and 4 tokens (1.3 s + 1.4 s).
    assert instance_makespan_s([3, 1], lat, 2, prompt_len=2) == pytest.approx(4.1)
    assert instance_makespan_s([3, 1], FLAT, 2, prompt_len=2) == pytest.approx(0.03)  # no kv term: 3 steps of 10 ms


def test_remaining_estimate_uses_progress_and_the_recent_overshoot_hand_worked():
    from streamrl.scheduling.rebalance import remaining_estimate

    recent = sorted([10, 20, 30, 40, 100])
    assert remaining_estimate(50, 12, 200, recent) == 38  # below its prediction: the difference
    # At 45 tokens, past its prediction of 30: the lengths that got past 45 are [100]: 55 more.
    assert remaining_estimate(30, 45, 200, recent) == 55
    assert remaining_estimate(30, 45, 60, recent) == 15  # never more than the token budget left
    assert remaining_estimate(30, 150, 400, recent) == 150  # nothing recent got this far: doubling
    assert remaining_estimate(5, 5, 200, []) == 5 and remaining_estimate(0, 0, 200, []) == 1  # at least 1


def test_predicted_generation_time_scales_with_instances_but_not_below_the_longest_request():
    from streamrl.scheduling.elastic import predict_gen_time

    assert predict_gen_time(12.0, 2, 3, t_tail=1.0) == pytest.approx(8.0)
    assert predict_gen_time(12.0, 2, 4, t_tail=9.0) == 9.0  # the tail: one request runs alone
    assert predict_gen_time(12.0, 2, 1, t_tail=1.0) == pytest.approx(24.0)


def test_elastic_scaler_adds_under_lag_removes_only_after_patience_and_does_not_flap():
    from streamrl.scheduling.elastic import ElasticScaler

    sc = ElasticScaler(min_instances=1, max_instances=3, patience=3, margin=0.25)
    assert sc.decide(1, t_gen=10.0, t_train=4.0, t_tail=1.0) == 1   # lag 6 >= the 5 one more instance saves
    assert sc.decide(2, t_gen=5.0, t_train=4.0, t_tail=1.0) == 0    # lag 1 < 1.67 saved: stay
    assert sc.decide(3, t_gen=3.0, t_train=4.0, t_tail=1.0) == 0    # at the cap, and generation is ahead
    # generation far ahead: with one fewer (3 -> 2: 4.5 s) it would still beat (1 - 0.25) x 8 = 6 s
    decisions = [sc.decide(3, t_gen=3.0, t_train=8.0, t_tail=1.0) for _ in range(3)]
    assert decisions == [0, 0, -1]  # only after three such iterations in a row
    assert sc.decide(2, t_gen=4.5, t_train=8.0, t_tail=1.0) == 0  # the removal is not undone
    # one fast iteration among slow ones never removes
    sc2 = ElasticScaler(min_instances=1, max_instances=3, patience=3, margin=0.25)
    assert [sc2.decide(2, t, 8.0, 1.0) for t in (3.0, 5.9, 3.0, 5.9, 3.0)] == [0] * 5
    # wholly tail-bound (the longest request is the whole stage): one more instance saves nothing
    assert ElasticScaler(1, 2).decide(1, t_gen=10.0, t_train=4.0, t_tail=10.0) == 0

"""The simulator: closed-form generation cases, links, calibration against PAPER.md, pipelines."""

import numpy as np
import pytest

from streamrl.scheduling.latency import H800_QWEN7B_VLLM, LatencyModel
from streamrl.lab.sim import cost as C
from streamrl.lab.sim.engine import simulate_generation
from streamrl.lab.sim.hardware import CROSS_DC_LINK, GBPS, Link, get_gpu, pipelined_chain_s, weight_push_s
from streamrl.lab.sim.models import get_model
from streamrl.lab.sim.systems import Deployment, get_system, run_system
from streamrl.lab.sim import experiments as E
from streamrl.lab.sim.workload import ReplayLengths, Workload, data_dir, r1_workload, top_recall

FLAT = LatencyModel(((1, 10.0), (2, 10.0)))  # 10 ms per decode step at any batch size


def flat_cost(max_batch=4, kv=1 << 40):
    return C.ProfiledDecode(FLAT, kv_capacity_tokens=kv, max_batch=max_batch)


def run(out_lens, queues, cost, prompt=0, rebalance=False):
    assign = [0] * len(out_lens)
    for i, q in enumerate(queues):
        for r in q:
            assign[r] = i
    return simulate_generation([prompt] * len(out_lens), out_lens, assign, queues, [cost] * len(queues), rebalance)


def test_one_instance_equal_lengths_finish_together():
    res = run([100] * 4, [[0, 1, 2, 3]], flat_cost(max_batch=4))
    assert np.allclose(res.finish_s, 1.0)  # 100 steps x 10 ms


def test_one_instance_batch_limit_makes_waves():
    res = run([100] * 4, [[0, 1, 2, 3]], flat_cost(max_batch=2))
    assert sorted(res.finish_s) == pytest.approx([1.0, 1.0, 2.0, 2.0])


def test_two_instances_lpt_order_shortens_makespan():
    # instance 0 holds lengths 10 and 30 (batch 1), instance 1 holds 20.
    lens = [10, 30, 20]
    fifo = run(lens, [[0, 1], [2]], flat_cost(max_batch=1))
    lpt = run(lens, [[1, 0], [2]], flat_cost(max_batch=1))
    assert fifo.finish_s.tolist() == pytest.approx([0.1, 0.4, 0.2])
    assert lpt.finish_s.tolist() == pytest.approx([0.4, 0.3, 0.2])
    assert lpt.makespan_s == pytest.approx(fifo.makespan_s)  # same total work on instance 0
    # LPT's benefit: with rebalancing the idle instance takes the queued short request.
    stolen = run(lens, [[1, 0], [2]], flat_cost(max_batch=1), rebalance=True)
    assert stolen.makespan_s == pytest.approx(0.3) and stolen.steals == 1


def test_rebalancing_runs_the_live_check_on_predicted_lengths():
    """The simulated SGS steals with ``scheduling.rebalance.plan_round``: the request whose move most
    shortens the *predicted* makespan, not the head of the queue. Instance 0 runs r0 (100 tokens)
    with qa (10) then qb (60) queued; instance 1 runs r1 (20); batch 1, 10 ms/token."""
    from streamrl.lab.sim.engine import Rebalancing

    lens, queues, assign = [100, 10, 60, 20], [[0, 1, 2], [3]], [0, 0, 0, 1]
    queued_only = Rebalancing(FLAT, running=False)

    def sim(rebalance, predicted=None):
        return simulate_generation([0] * 4, lens, assign, queues, [flat_cost(max_batch=1)] * 2, rebalance, predicted)

    # At 0.2 s instance 1 idles; r0 has 80 tokens left. Moving qb leaves max(0.9, 0.6), qa max(1.4, 0.1).
    oracle = sim(queued_only)
    assert oracle.instance.tolist() == [0, 1, 1, 1] and oracle.steals == 2
    assert oracle.finish_s[2] == pytest.approx(0.8) and oracle.finish_s[1] == pytest.approx(0.9)  # qb, then qa
    # Believing qa is the long one, it takes qa first (it finishes at 0.3), then qb.
    swapped = sim(queued_only, predicted=[100, 60, 10, 20])
    assert swapped.finish_s[1] == pytest.approx(0.3) and swapped.finish_s[2] == pytest.approx(0.9)
    assert swapped.makespan_s == pytest.approx(1.0) and oracle.makespan_s == pytest.approx(1.0)
    # Running requests may move too (the default): r0 itself goes, with its 20 tokens, since
    # max(0.7, 0.8) beats qb's max(0.9, 0.6); instance 0 goes on with qa, then qb.
    running = sim(True)
    assert running.instance.tolist() == [1, 0, 0, 1] and running.steals == 1
    assert running.finish_s.tolist() == pytest.approx([1.0, 0.3, 0.9, 0.2])


def test_a_running_request_moved_by_rebalancing_finishes_once_with_its_prefix_counted():
    """Instance 0 holds two long requests in a batch of 2 while instance 1 has a short one; when
    instance 1 idles it takes one running request, which continues from where it stopped (its
    tokens so far count), and instance 0 goes on alone from that step. A step costs 5 ms alone
    and 10 ms for two: PTL(1) < PTL(2) is what makes the move pay."""
    steep = C.ProfiledDecode(LatencyModel(((1, 5.0), (2, 10.0))), kv_capacity_tokens=1 << 40, max_batch=2)
    lens, queues, assign = [300, 300, 50], [[0, 1], [2]], [0, 0, 1]
    plain = simulate_generation([0] * 3, lens, assign, queues, [steep] * 2)
    moved = simulate_generation([0] * 3, lens, assign, queues, [steep] * 2, rebalance=True)
    assert plain.makespan_s == pytest.approx(3.0) and plain.steals == 0  # 300 steps of two at 10 ms
    # At 0.25 s instance 1 is done (50 x 5 ms) and the two long ones have 275 tokens left each:
    # one moves, and both finish their 275 alone at 5 ms: 0.25 + 1.375 s.
    assert moved.steals == 1 and sorted(moved.instance.tolist()) == [0, 1, 1]
    assert moved.finish_s.tolist() == pytest.approx([1.625, 1.625, 0.25])
    # on the FLAT curve (10 ms at any batch size) the move gains nothing, so nothing moves
    assert run(lens, queues, flat_cost(max_batch=2), rebalance=True).steals == 0


def test_kv_cache_full_preempts_newest_and_recomputes():
    # two requests (prompt 10, 100 tokens); cache 150 tokens: full after (150 - 20) / 2 = 65 steps.
    res = run([100, 100], [[0, 1]], flat_cost(max_batch=2, kv=150), prompt=10)
    assert res.preemptions == 1
    assert res.finish_s[0] == pytest.approx(1.0)  # 100 steps
    assert res.finish_s[1] == pytest.approx(1.35)  # then its remaining 35 steps


def test_link_transfer_closed_form():
    link = Link(1e9, 0.001)
    assert link.transfer_s(2e9) == pytest.approx(2.001)
    # two hops, 10 GB/s and 5 GB/s, 1 GB in 100 MB chunks: latencies + 1e9/5e9 + one chunk at 5 GB/s.
    hops = [Link(10e9, 0.001), Link(5e9, 0.002)]
    assert pipelined_chain_s(1e9, hops, chunk_bytes=1e8) == pytest.approx(0.003 + 0.2 + 0.02)


def test_cross_dc_push_sends_one_copy_over_the_slow_link():
    w = get_model("qwen2.5-7b").weight_bytes
    t = weight_push_s(w, get_gpu("H20"), 32, 1, CROSS_DC_LINK)
    assert t >= w / (80 * GBPS)  # at least one full copy over 80 Gbps
    assert t < 2 * w / (80 * GBPS)  # and not two


def test_roofline_reproduces_paper_ptl_table():
    dec = C.RooflineDecode(get_gpu("H800"), get_model("qwen2.5-7b"), 1)
    for bs, ms in H800_QWEN7B_VLLM.points:
        assert dec.step_s(bs, bs * C.PTL_CONTEXT) * 1000 == pytest.approx(ms, rel=0.05)


def test_training_scales_with_devices_like_paper():
    """§1: training time falls to 0.54/0.30/0.19 from 8 to 16/24/32 GPUs; the default model scales
    linearly (no memory-pressure penalty), within 0.1 of each; the optional pressure term
    (``KAPPA``) makes it super-linear."""
    m, g = get_model("qwen2.5-7b"), get_gpu("H800")
    seqs = [3000.0] * 64
    t8 = C.RooflineTrain(g, m, 8).train_s(seqs)
    ratios = [C.RooflineTrain(g, m, y).train_s(seqs) / t8 for y in (16, 24, 32)]
    assert ratios == pytest.approx([0.54, 0.30, 0.19], abs=0.1)  # PAPER.md §1
    assert ratios == pytest.approx([1 / 2, 1 / 3, 1 / 4], rel=1e-6)
    saved = C.KAPPA
    try:
        C.KAPPA = 0.55
        t8 = C.RooflineTrain(g, m, 8).train_s(seqs)
        assert C.RooflineTrain(g, m, 32).train_s(seqs) / t8 < 8 / 32
    finally:
        C.KAPPA = saved


def test_generation_scales_poorly_like_paper():
    wl = r1_workload(20000)
    m, g = get_model("qwen2.5-7b"), get_gpu("H800")
    spec = get_system("colocated")
    batch, hist = wl.sample(np.random.default_rng(0)), wl.sample(np.random.default_rng(1)).out_lens
    from streamrl.lab.sim.systems import generate

    t = {x: generate(batch, spec, Deployment(m, g, x, 1, g, x), hist).makespan_s for x in (8, 32)}
    assert 0.55 < t[32] / t[8] < 0.85  # PAPER.md §1: 0.69


def test_ranker_noise_matches_table4_recall():
    wl = r1_workload(20000)
    b = wl.sample(np.random.default_rng(0))
    assert top_recall(b.out_lens, b.predicted, 0.2) == pytest.approx(0.87, abs=0.05)


def test_r1_lengths_shape():
    out = r1_workload(20000).sample(np.random.default_rng(0)).out_lens
    hist, edges = np.histogram(out, bins=20, range=(0, 20000))
    assert 1000 <= edges[np.argmax(hist)] <= 3000  # mode ~2K
    assert out.max() == 20000 and 0.01 < (out == 20000).mean() < 0.1  # long tail to the cap


@pytest.mark.data
def test_replay_lengths_from_real_csv():
    path = data_dir() / "skythought_response_lengths.csv"
    if not path.exists():
        pytest.skip(f"{path} absent (set STREAMRL_DATA_DIR to ../shared/data)")
    lengths = ReplayLengths.from_file(path, 20000, model_label="Sky-T1")
    out = Workload(lengths, 256).sample(np.random.default_rng(0)).out_lens
    assert out.max() <= 20000 and np.median(out) < out.mean()  # right-skewed


def tiny_deployment(pipeline_tokens_per_s=2000.0):
    prof = LatencyModel(((1, 5.0), (8, 8.0), (32, 20.0)), "transformers", "tiny", "cpu")
    m, g = get_model("qwen2.5-7b"), get_gpu("H800")
    return Deployment(m, g, 2, 1, g, 1, decode_override=C.ProfiledDecode(prof),
                      train_override=C.ProfiledTrain(pipeline_tokens_per_s, 1, 1))


def test_modes_order_on_a_profiled_tiny_setup():
    dep = tiny_deployment()
    wl = r1_workload(256, num_prompts=64)
    tput = {name: run_system(get_system(name), dep, wl, iterations=5).samples_per_s
            for name in ("disagg-batch", "stream-sync", "stream-async", "colocated")}
    assert tput["stream-sync"] >= tput["disagg-batch"] * 0.999
    assert tput["stream-async"] >= tput["stream-sync"] * 0.999


def test_async_never_exceeds_staleness_bound():
    res = run_system(get_system("stream-async"), tiny_deployment(), r1_workload(256, num_prompts=64), iterations=6)
    it = res.iterations
    for i in range(2, len(it)):
        # gen(i) uses W_{i-2}: it cannot start before train(i-2) ended
        assert it[i]["gen_start"] >= it[i - 2]["train_end"] - 1e-9


def test_simulate_cli_writes_json(tmp_path):
    from streamrl.cli import main

    out = tmp_path / "e2e.json"
    assert main(["simulate", "e2e", "--models", "7b", "--max-lens", "5000", "--systems", "colocated,stream-async",
                 "--iterations", "2", "--out", str(out)]) == 0
    import json

    rows = json.loads(out.read_text())["rows"]
    assert {r["system"] for r in rows} == {"colocated", "stream-async"}
    assert all(r["samples_per_s"] > 0 and r["model"] == "qwen2.5-7b" and r["gpus"] == 32 for r in rows)


def test_profiled_train_charges_a_prepare_call_in_batched_passes():
    from dataclasses import replace

    from streamrl.trainer.trainer import Prepared, micro_batches

    lens = [30, 12, 50, 7, 7, 41, 60, 25]
    items = sorted((Prepared(list(range(n)), 1, [], 0.0, 0, "p") for n in lens), key=lambda p: p.num_tokens)
    # the simulator cuts passes exactly as the live trainer's prepare does (sorted, then micro_batches)
    assert C.micro_batch_shapes(lens, 100) == [(len(mb), max(p.num_tokens for p in mb)) for mb in micro_batches(items, 100)]
    t = C.ProfiledTrain(1000.0, prepare_pass_s=0.01, prepare_token_s=1e-5, micro_batch_tokens=100)
    passes = C.micro_batch_shapes(lens, 100)
    assert t.prepare_s(lens) == pytest.approx(0.01 * len(passes) + 1e-5 * sum(r * m for r, m in passes))
    assert t.prepare_s([]) == 0.0
    assert t.prepare_s(lens) < sum(t.prepare_s([n]) for n in lens)  # 4 passes instead of 8
    wide = replace(t, micro_batch_tokens=4096)  # one pass for all 8: far less than 8 calls of one
    assert wide.prepare_s(lens) < 0.25 * sum(wide.prepare_s([n]) for n in lens)
    assert np.allclose(t.seq_train_s([10, 20]), [0.01, 0.02])  # optimizer steps: per token only
    assert t.train_s([10, 20]) == pytest.approx(t.prepare_s([10, 20]) + 0.03)
    assert C.ProfiledTrain(1000.0, devices=2, prepare_pass_s=0.01).train_s([10, 20]) == pytest.approx(0.02)
    assert C.ProfiledTrain(1000.0).train_s([10, 20]) == pytest.approx(0.03)  # combined rate: tokens only


def test_stream_calls_follow_the_outbox_rule():
    from streamrl.lab.sim.systems import call_stream_train

    one_pass = C.ProfiledTrain(1e9, prepare_pass_s=0.1).prepare_s  # 0.1 s per call of any size here
    zero = np.zeros(5)
    # t=0: alone (trainer free) until 0.1; 0.05-0.07 finish while it is busy and wait; the sample
    # at 0.5 finds it free and takes them along: two calls in all.
    end, busy = call_stream_train(np.array([0.0, 0.05, 0.06, 0.07, 0.5]), np.full(5, 10.0), zero, one_pass, 0.0, 1e15)
    assert (end, busy) == pytest.approx((0.6, 0.2))
    # generation ends while the trainer is busy: the outbox goes when it is free
    end, busy = call_stream_train(np.array([0.0, 0.05, 0.06, 0.07]), np.full(4, 10.0), zero[:4], one_pass, 0.0, 1e15)
    assert (end, busy) == pytest.approx((0.2, 0.2))
    # a trainer still busy (stream-async: the previous iteration) gets the first call queued behind it
    end, busy = call_stream_train(np.array([0.0, 0.05, 0.5]), np.full(3, 10.0), zero[:3], one_pass, 0.3, 1e15)
    assert (end, busy) == pytest.approx((0.6, 0.2))
    # a trainer that keeps up pays one call per sample; optimizer steps every 20 tokens, remainder at the end
    free = C.ProfiledTrain(1e9).prepare_s
    end, busy = call_stream_train(np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.full(5, 10.0), np.full(5, 0.2), free, 0.0, 20)
    assert (end, busy) == pytest.approx((4.2, 1.0))  # steps at samples 2 and 4 (0.4 each), the last alone (0.2)
    end, busy = call_stream_train(np.array([0.0, 1.0, 2.0, 3.0, 4.0]), np.full(5, 10.0), zero, one_pass, 0.0, 1e15)
    assert (end, busy) == pytest.approx((4.1, 0.5))


def test_stream_modes_prepare_in_batched_calls_when_the_trainer_lags():
    """Expensive prepare passes (0.5 s each): while the trainer is busy, finishing samples pile up
    and go together, so a stream iteration pays a few passes instead of one per sample (32 s);
    disagg-batch pays one for the whole iteration."""
    train = C.ProfiledTrain(50_000.0, prepare_pass_s=0.5, micro_batch_tokens=1 << 20)
    prof = LatencyModel(((1, 5.0), (8, 8.0), (32, 20.0)), "transformers", "tiny", "cpu")
    m, g = get_model("qwen2.5-7b"), get_gpu("H800")
    dep = Deployment(m, g, 2, 1, g, 1, decode_override=C.ProfiledDecode(prof), train_override=train)
    wl = r1_workload(256, num_prompts=64)
    res = {name: run_system(get_system(name), dep, wl, iterations=3) for name in ("disagg-batch", "stream-sync", "stream-async")}
    for name in ("stream-sync", "stream-async"):
        assert all(1.0 < r["t_train"] < 0.25 * 64 * 0.5 for r in res[name].iterations)
    one_call = max(r["t_train"] for r in res["disagg-batch"].iterations)
    assert one_call < min(r["t_train"] for r in res["stream-sync"].iterations)
    assert res["stream-async"].samples_per_s > res["disagg-batch"].samples_per_s


def tiny_profile(colocated: bool = True) -> dict:
    """A profile in ``streamrl profile``'s format with round numbers (call trainer form)."""
    prof = {"points": [{"batch_size": 1, "ms_per_token": 2.0}, {"batch_size": 64, "ms_per_token": 10.0}],
            "train_tokens_per_s": 1000.0, "threads": 1, "prompt_len_mean": 10.0,
            "prefill": {"s_per_request": 0.001, "tokens_per_s": 10 / 0.001},
            "train": {"train_tokens_per_s": 1000.0, "train_step_tokens_per_s": 2000.0, "prepare_unit": "sample",
                      "prepare_s_per_pass": 0.01, "prepare_s_per_padded_token": 1e-5, "micro_batch_tokens": 1000}}
    if colocated:
        prof["colocated"] = {"threads": 2, "points": [{"batch_size": 1, "ms_per_token": 4.0},
                                                      {"batch_size": 64, "ms_per_token": 20.0}],
                             "train_tokens_per_s": 800.0,
                             "prefill": {"s_per_request": 0.002, "tokens_per_s": 10 / 0.002},
                             "train": {"train_step_tokens_per_s": 4000.0, "prepare_unit": "sample",
                                       "prepare_s_per_pass": 0.02, "prepare_s_per_padded_token": 2e-5,
                                       "micro_batch_tokens": 1000}}
    return prof


def test_live_colocated_step_is_generation_plus_install_plus_training():
    """One instance, 128 requests of equal length L, at most 64 running: two waves of 64
    admissions + prefills and L decode steps at PTL(64); then the weight install; then 128 x
    (p + L) tokens at the optimizer-step rate after one prepare call of all 128 (passes of 33 x 30
    padded tokens under the 1000-token budget), all from the profile's colocated (2-thread) numbers."""
    from streamrl.lab.sim import live

    L, n = 20, 128
    res = live.simulate_tiny_modes(tiny_profile(), prompts_per_iter=32, n_samples=4, max_new_tokens=200,
                                   lengths=[L], iterations=3, modes=("colocated", "disagg-batch"))
    rows = {r["mode"]: r for r in res["rows"]}
    gen = n * 0.002 + 2 * L * 0.020
    passes = -(-n // 33)  # 33 rows of 30 tokens fit in 1000
    train = passes * 0.02 + n * (10 + L) * 2e-5 + n * (10 + L) / 4000.0
    assert rows["colocated"]["sim_gen_s"] == pytest.approx(gen)
    assert rows["colocated"]["sim_train_s"] == pytest.approx(train)
    assert rows["colocated"]["sim_step_s"] == pytest.approx(gen + live.WEIGHT_INSTALL_S + train)
    # disaggregated: 1-thread numbers, nothing overlaps in disagg-batch
    gen1, train1 = n * 0.001 + 2 * L * 0.010, passes * 0.01 + n * (10 + L) * 1e-5 + n * (10 + L) / 2000.0
    assert rows["disagg-batch"]["sim_gen_s"] == pytest.approx(gen1)
    assert rows["disagg-batch"]["sim_train_s"] == pytest.approx(train1)
    assert rows["disagg-batch"]["sim_step_s"] == pytest.approx(gen1 + train1, rel=1e-3)  # + a tiny-weight push


def test_live_falls_back_to_combined_rate_and_thread_scaling():
    from streamrl.lab.sim import live

    prof = tiny_profile(colocated=False)
    del prof["train"], prof["prefill"]
    scaling = [{"threads": 1, "gen_tokens_per_s": 100.0, "train_tokens_per_s": 100.0},
               {"threads": 2, "gen_tokens_per_s": 50.0, "train_tokens_per_s": 200.0}]
    res = live.simulate_tiny_modes(prof, prompts_per_iter=32, n_samples=4, max_new_tokens=200, lengths=[20],
                                   iterations=2, modes=("colocated",), thread_scaling=scaling)
    row = res["rows"][0]
    assert row["sim_train_s"] == pytest.approx(128 * 30 / 2000.0)  # 1000 tok/s x 2 (training twice as fast)
    assert row["sim_gen_s"] == pytest.approx(2 * 20 * 0.020)  # generation half as fast


def test_profiled_decode_charges_context_beyond_the_ptl_runs():
    from streamrl.lab.sim import live

    lat = LatencyModel(((1, 2.0), (8, 4.0)), "transformers", "tiny", "cpu", {"kv_ms_per_token": 0.001})
    ctx = live.ptl_context({"prompt_len_mean": 8.9, "new_tokens": 32})
    assert ctx == 25.0  # 9-token prompts, 32 decode steps
    d = live._deployment(live.tiny_shape({}), lat, C.ProfiledTrain(1000.0), 1, 8, profiled_context=ctx).decode_override
    assert d.step_s(8, 8 * ctx) == pytest.approx(0.004)  # at the profiled context: PTL itself
    assert d.step_s(8, 8 * (ctx + 100)) == pytest.approx(0.004 + 800 * 1e-6)
    assert C.ProfiledDecode(lat).step_s(8, 1e6) == pytest.approx(0.004)  # context-free by default


def test_live_rejects_the_old_per_unit_prepare_form():
    from streamrl.lab.sim import live

    prof = tiny_profile(colocated=False)
    prof["train"] = {"train_step_tokens_per_s": 2000.0, "prepare_unit": "sample", "prepare_s_per_unit": 0.01}
    with pytest.raises(ValueError, match="re-run `streamrl profile`"):
        live.profiled_train(prof)


def test_fit_prepare_calls_recovers_pass_and_token_costs():
    from streamrl.lab.profiling.measure import call_sizes, fit_prepare_calls

    rows = [{"passes": p, "padded_tokens": t, "s": 0.006 * p + 2e-6 * t} for p, t in ((1, 30), (1, 500), (3, 9000), (5, 16000))]
    assert fit_prepare_calls(rows) == pytest.approx((0.006, 2e-6))
    rows = [{"passes": p, "padded_tokens": t, "s": 0.006 * p - 1e-7 * t} for p, t in ((1, 30), (2, 8000), (5, 16000))]
    pass_s, token_s = fit_prepare_calls(rows)  # a negative token term is noise: per pass only
    assert token_s == 0.0 and pass_s > 0
    assert call_sizes(128) == [1, 2, 4, 8, 16, 32, 64, 128] and call_sizes(6) == [1, 2, 4, 6] and call_sizes(1) == [1]


def test_fit_per_sample_recovers_overhead_and_slope():
    from streamrl.lab.profiling.measure import fit_per_sample

    toks = [10, 20, 30, 40]
    a, b = fit_per_sample([0.005 + 1e-4 * x for x in toks], toks)
    assert a == pytest.approx(0.005) and b == pytest.approx(1e-4)
    a, b = fit_per_sample([0.01, 0.01, 0.01], [10, 20, 30])  # flat: per-call overhead only
    assert a == pytest.approx(0.01) and b == pytest.approx(0.0, abs=1e-12)
    a, b = fit_per_sample([1e-4 * x - 1e-4 for x in toks], toks)  # negative intercept: through the origin
    assert a == 0.0 and b > 0


def test_sim_elastic_applies_the_rule_each_iteration():
    from streamrl.scheduling.elastic import should_add_instance
    from streamrl.lab.sim.experiments import elastic

    res = elastic(iterations=6)
    rows, tp = res["iterations"], res["tp"]
    assert any(r["added"] for r in rows)
    for r, nxt in zip(rows, rows[1:]):
        t_plus = r["t_gen_s"] - r["delta_prime_s"]
        assert r["added"] == int(should_add_instance(r["t_gen_s"], r["t_train_s"], t_plus))
        assert nxt["gen_gpus"] == r["gen_gpus"] + tp * r["added"]
        assert nxt["train_gpus"] == r["train_gpus"]


def test_fit_prefill_takes_the_per_request_slope():
    from streamrl.lab.profiling.measure import fit_prefill

    ptl = [{"batch_size": b, "ms_per_token": 2.0} for b in (1, 8, 64)]
    one = [{"batch_size": b, "one_token_s": 0.004 + 0.002 + 0.0005 * b, "prompt_len": 10} for b in (1, 8, 64)]
    pf = fit_prefill(one, ptl)
    assert pf["s_per_request"] == pytest.approx(0.0005)
    assert pf["fixed_s"] == pytest.approx(0.004)
    assert pf["tokens_per_s"] == pytest.approx(10 / 0.0005)


def test_arrivals_hold_requests_back_and_join_the_running_batch():
    # one instance, 4 slots, 10 ms steps: request 1 arrives at 0.5 s while request 0 runs
    cost = flat_cost(max_batch=4)
    res = simulate_generation([0, 0], [100, 20], [0, 0], [[0, 1]], [cost], arrivals=[0.0, 0.5])
    assert res.finish_s[0] == pytest.approx(1.0)  # not slowed: the step cost is flat
    assert res.finish_s[1] == pytest.approx(0.5 + 0.2, abs=0.011)  # joins at the first step after 0.5 s
    same = simulate_generation([0, 0], [100, 20], [0, 0], [[0, 1]], [cost], arrivals=[0.0, 0.0])
    plain = simulate_generation([0, 0], [100, 20], [0, 0], [[0, 1]], [cost])
    assert np.array_equal(same.finish_s, plain.finish_s)
    idle = simulate_generation([0], [10], [0], [[0]], [cost], arrivals=[2.0])  # an idle instance waits for it
    assert idle.finish_s[0] == pytest.approx(2.1)
    with pytest.raises(ValueError, match="arrival order"):
        simulate_generation([0, 0], [10, 10], [0, 0], [[0, 1]], [cost], arrivals=[1.0, 0.0])


@pytest.mark.parametrize("name,k", [("stream-async-partial", 1), ("stream-async-k2-partial", 2),
                                    ("stream-async-k4-partial", 4)])
def test_partial_rollout_admissions_hold_the_bound_whatever_the_lengths(name, k):
    """Randomised output lengths (a length scale per iteration): every batch is admitted only
    once version i - k was installed, in order, and the trainer still takes iterations in order."""
    spec = get_system(name)
    dep = tiny_deployment()
    for seed in range(3):
        scales = list(np.random.default_rng(seed).uniform(0.2, 1.5, 7))
        res = run_system(spec, dep, r1_workload(256, num_prompts=32), iterations=7, seed=seed, length_scales=scales)
        it = res.iterations
        assert all(r["staleness_max"] <= k for r in it)
        assert all(b["gen_start"] >= a["gen_start"] for a, b in zip(it, it[1:]))
        assert all(b["train_end"] > a["train_end"] for a, b in zip(it, it[1:]))
        for i in range(k + 1, len(it)):  # version i - k is the result of training i - k - 1
            assert it[i]["gen_start"] >= it[i - k - 1]["train_end"] - 1e-9


def test_partial_rollout_removes_the_tail_bubble_when_generation_limits():
    """A generation-bound setup (slow decode, fast trainer): admitting the next iteration into the
    tail's free slots raises throughput; the plain staleness bound cannot (each iteration still
    waits for the last one's tail)."""
    dep = tiny_deployment(pipeline_tokens_per_s=1e6)
    wl = r1_workload(256, num_prompts=64)
    rate = {n: run_system(get_system(n), dep, wl, iterations=6).samples_per_s
            for n in ("stream-async", "stream-async-k2", "stream-async-k2-partial")}
    assert rate["stream-async-k2"] == pytest.approx(rate["stream-async"])
    assert rate["stream-async-k2-partial"] > 1.05 * rate["stream-async"]


def test_hetero_compares_the_deployment_as_set_up_and_algorithm_1s_shrunk_form():
    rows = E.hetero(max_lens=(5000,), iterations=2)
    by = {r["setup"]: r for r in rows}
    assert set(by) == {"cross-dc", "cross-dc-all", "single-dc"}
    assert (by["cross-dc-all"]["gen"], by["cross-dc-all"]["train"]) == ("32xH20", "16xH800")
    assert by["cross-dc-all"]["cost"] == pytest.approx(4 * 1.00 + 2 * 2.85)  # PAPER.md Table 1, per 8-GPU machine
    assert by["single-dc"]["cost"] == pytest.approx(4 * 2.85) and by["single-dc"]["gain"] == pytest.approx(1.0)
    # the shrunk form keeps one side whole and charges only what it keeps
    shrunk = by["cross-dc"]
    assert shrunk["gen"] == "32xH20" and int(shrunk["train"].split("x")[0]) <= 16
    assert shrunk["cost"] <= by["cross-dc-all"]["cost"]
    for r in rows:
        assert r["gain"] == pytest.approx(r["samples_per_s_per_cost"] / by["single-dc"]["samples_per_s_per_cost"])

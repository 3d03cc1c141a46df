"""Scheduling benches: the pieces that need no engine (mode variants, the makespan lower bound)."""

import pytest

from streamrl.lab.bench.modes import mode_config
from streamrl.lab.bench.scheduling import lower_bound_s
from streamrl.config import load_config
from streamrl.scheduling.latency import LatencyModel


def test_mode_variant_switches_on_skewness_aware_dispatch_and_lpt():
    cfg = load_config(None, ["generation.dispatch=random"])
    skew = mode_config(cfg, "stream-async+skew")
    assert (skew.mode, skew.generation.dispatch, skew.generation.order) == ("stream-async", "skewness-aware", "lpt")
    plain = mode_config(cfg, "stream-async")
    assert (plain.generation.dispatch, plain.generation.order) == ("random", "fifo")
    assert cfg.mode == "colocated"  # the caller's config is not modified


def test_async_rows_beyond_one_step_set_the_bound_and_partial_rollout():
    cfg = load_config(None, [])
    k4p = mode_config(cfg, "stream-async-k4-partial+skew")
    assert (k4p.mode, k4p.staleness_bound(), k4p.generation.partial_rollout) == ("stream-async", 4, True)
    assert k4p.generation.dispatch == "skewness-aware"
    k2 = mode_config(cfg, "stream-async-k2")
    assert (k2.staleness_bound(), k2.generation.partial_rollout) == (2, False)
    p1 = mode_config(cfg, "stream-async-partial")
    assert (p1.staleness_bound(), p1.generation.partial_rollout) == (1, True)
    with pytest.raises(ValueError, match="k must be >= 1"):
        mode_config(cfg, "stream-async-k0")
    with pytest.raises(ValueError, match="stream-async-k<k>"):
        mode_config(cfg, "stream-async-kx")


def test_mode_variant_rejects_unknown_names_naming_them():
    cfg = load_config(None, [])
    with pytest.raises(ValueError, match="'fast'"):
        mode_config(cfg, "stream-async+fast")
    with pytest.raises(ValueError, match="'turbo'"):
        mode_config(cfg, "turbo")
    with pytest.raises(ValueError, match="colocated"):
        mode_config(cfg, "colocated+skew")


def test_lower_bound_is_the_longer_of_longest_alone_and_all_tokens_at_peak():
    # PTL: 10 ms at BS 1, 20 ms at BS 4 -> peak 4 / 0.02 = 200 tokens/s per instance (BS <= 4).
    lat = LatencyModel(((1, 10.0), (4, 20.0), (8, 80.0)))
    lb = lower_bound_s([100, 10, 10, 10], lat, instances=2, batch=4)
    assert lb["longest_alone_s"] == pytest.approx(1.0)          # 100 tokens x 10 ms
    assert lb["all_tokens_at_peak_s"] == pytest.approx(130 / 400)  # 130 tokens at 2 x 200 tokens/s
    assert lb["lower_bound_s"] == pytest.approx(1.0)
    many = lower_bound_s([50] * 40, lat, instances=2, batch=4)
    assert many["lower_bound_s"] == pytest.approx(2000 / 400)  # the token term dominates
    assert many["context_s"] == 0.0


def test_lower_bound_adds_every_tokens_context_cost_whatever_the_schedule():
    # kv 0.01 ms per context token. Samples of 3 and 2 tokens after prompts of 5: their tokens hold
    # contexts 5, 6, 7 and 5, 6 -> 29 context tokens -> 0.29 ms in all, 0.145 ms per instance.
    lat = LatencyModel(((1, 10.0), (4, 20.0)), extra={"kv_ms_per_token": 0.01})
    lb = lower_bound_s([3, 2], lat, instances=2, batch=4, prompt_len=5)
    assert lb["context_s"] == pytest.approx(0.29e-3 / 2)
    assert lb["all_tokens_at_peak_s"] == pytest.approx((5 / 200 + 0.29e-3) / 2)
    # the longest alone: 3 tokens x 10 ms plus its own contexts 5 + 6 + 7 = 18 x 0.01 ms
    assert lb["longest_alone_s"] == pytest.approx(0.030 + 0.18e-3)
    assert lb["lower_bound_s"] == pytest.approx(lb["longest_alone_s"])


def test_bench_modes_rejects_colocated_thread_counts_beyond_the_cluster(tmp_path):
    from streamrl.lab.bench.modes import bench_modes

    cfg = load_config("configs/bench.yaml", [])
    with pytest.raises(ValueError, match=r"colocated_threads \[3\]"):
        bench_modes(cfg, 0, 1, tmp_path, modes=("colocated",), colocated_threads=(1, 3))


@pytest.mark.slow
def test_history_policy_lengths_reach_the_ranker_for_every_batch_prompt(ray_session, tiny_policy_dir):
    """A later-epoch bench: the earlier checkpoint's greedy lengths are what ``history`` ranks by."""
    from streamrl.lab.bench.scheduling import CONFIGS, bench_scheduling

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "generation.max_new_tokens=24", "task.num_train=64",
                             "cluster.num_cpus=2"])
    configs = tuple(c for c in CONFIGS if c.name in ("random+fifo", "skew+ranker"))
    res = bench_scheduling(cfg, prompts=8, instances=2, batch=2, repeats=1, ranker="history", ranker_prompts=8,
                           profile="profiles/cpu-tiny.json", configs=configs, history_policy=tiny_policy_dir,
                           echo=lambda *_: None)
    hist, batch = res["recorded_lengths"]["history"], res["recorded_lengths"]["batch"]
    assert set(hist) == set(batch) and hist == batch  # same weights, greedy: the same lengths
    assert res["ranker"]["fit_prompts"] == 8 + 8  # the other prompts and the batch prompts' history
    assert res["ranker_scores"] == pytest.approx(hist)  # one remembered length per prompt is its score
    assert res["ranker"]["history_policy"] == tiny_policy_dir and "spearman" in res["ranker"]["history_alone"]
    assert [r["config"] for r in res["rows"]] == ["random+fifo", "skew+ranker"]


@pytest.mark.slow
def test_batches_are_disjoint_and_the_table_is_the_mean_of_each_batchs_ratios(ray_session, tiny_policy_dir):
    """``batches=2``: two disjoint batches, each recorded and run; every aggregate ratio and check is the
    mean over batches of that batch's own ratio."""
    from streamrl.lab.bench.scheduling import CONFIGS, bench_scheduling

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "generation.max_new_tokens=24", "task.num_train=64",
                             "cluster.num_cpus=2"])
    configs = tuple(c for c in CONFIGS if c.name in ("random+fifo", "skew+oracle", "skew+oracle+rebalance"))
    res = bench_scheduling(cfg, prompts=8, instances=2, batch=2, repeats=1, ranker="learned", ranker_prompts=16,
                           profile="profiles/cpu-tiny.json", configs=configs, batches=2, echo=lambda *_: None)
    pbs = res["per_batch"]
    assert [pb["batch"] for pb in pbs] == [0, 1] and res["setup"]["batches"] == 2
    assert len(res["recorded_lengths"]["batch"]) == 16  # 2 x 8 distinct prompts, every one recorded
    assert not set(res["recorded_lengths"]["batch"]) & set(res["recorded_lengths"]["ranker_data"])
    assert set(res["ranker_scores"]) == set(res["recorded_lengths"]["batch"])
    for row in res["rows"]:
        per = [next(r for r in pb["rows"] if r["config"] == row["config"]) for pb in pbs]
        assert row["vs_random_fifo_by_batch"] == [r["vs_random_fifo"] for r in per]
        assert row["vs_random_fifo"] == pytest.approx(sum(r["vs_random_fifo"] for r in per) / 2)
        assert all(run["tokens"] > 0 for r in per for run in r["runs"])  # every run returned its batch
    check = next(c for c in res["checks"] if c["check"].startswith("skew+oracle+rebalance <= skew+oracle (wall)"))
    by = [{r["config"]: r for r in pb["rows"]} for pb in pbs]
    assert check["by_batch"] == pytest.approx([b["skew+oracle+rebalance"]["makespan_s"] / b["skew+oracle"]["makespan_s"] for b in by])
    assert check["value"] == pytest.approx(sum(check["by_batch"]) / 2)

"""The planner: Algorithm 1 over the simulator's estimators and over measured profiles."""

import json

import pytest

from streamrl.lab.sim.estimators import ProfileEstimator, SimEstimator
from streamrl.lab.planner.plan import plan_cross_dc, plan_single_dc
from streamrl.scheduling.latency import LatencyModel, save_profile
from streamrl.lab.sim.hardware import get_gpu
from streamrl.lab.sim.models import get_model
from streamrl.lab.sim.workload import r1_workload


def small_estimator(gen="H800", train="H800", max_len=5000):
    return SimEstimator(get_model("qwen2.5-7b"), get_gpu(gen), get_gpu(train), r1_workload(max_len, num_prompts=256))


def test_single_dc_plan_is_feasible_and_balanced():
    est = small_estimator()
    row = plan_single_dc(est, 16)
    assert row["gen_gpus"] + row["train_gpus"] <= 16
    assert row["gen_gpus"] == row["gen_tp"] * row["gen_instances"]
    assert row["t_iter_s"] == max(row["t_gen_s"], row["t_train_s"])
    # no other split is better (Algorithm 1 is exhaustive)
    for x in range(1, 16):
        for y in range(1, 17 - x):
            assert max(est.p_gen(x), est.p_train(y)) >= row["t_iter_s"] - 1e-9


def test_cross_dc_plan_keeps_the_slower_side_whole():
    row = plan_cross_dc(small_estimator("H20", "H800"), 16, 8)
    assert row["gen_gpus"] == 16 or row["train_gpus"] == 8
    assert row["gen_gpus"] <= 16 and row["train_gpus"] <= 8


def test_72b_does_not_fit_on_one_gpu():
    est = SimEstimator(get_model("qwen2.5-72b"), get_gpu("H800"), get_gpu("H800"), r1_workload(5000, num_prompts=64))
    assert est.gen_unit >= 4
    assert est.p_train(8) == float("inf")  # 2.5 TB of training states


def test_profile_estimator_scales_training_linearly(tmp_path):
    prof = LatencyModel(((1, 5.0), (16, 10.0)), "transformers", "tiny", "cpu", {"train_tokens_per_s": 1000.0})
    save_profile(prof, tmp_path / "p.json")
    est = ProfileEstimator(prof, 1000.0, r1_workload(256, num_prompts=32))
    assert est.p_train(2) == pytest.approx(est.p_train(1) / 2)
    assert est.p_gen(2) <= est.p_gen(1)
    row = plan_single_dc(est, 4)
    assert row["gen_gpus"] + row["train_gpus"] <= 4


def test_plan_cli_single_and_cross_dc(tmp_path):
    from streamrl.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "16", "--max-len", "5000", "--batch", "256", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())["plan"]
    assert plan["gen_gpus"] + plan["train_gpus"] <= 16
    assert main(["plan", "--gen-gpus", "16", "--gen-gpu-type", "H20", "--train-gpus", "8", "--train-gpu-type", "H800",
                 "--max-len", "5000", "--batch", "256", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["plan"]["gpu"] == "H20+H800"


def test_sweep_shows_every_frontier_split_with_the_chosen_one_best_and_inside_the_flat_band():
    est = small_estimator()
    row, sweep = plan_single_dc(est, 16, sweep=True)
    cands = sweep["candidates"]
    assert [c["chosen"] for c in cands].count(True) == 1
    chosen = next(c for c in cands if c["chosen"])
    assert (chosen["gen_gpus"], chosen["train_gpus"]) == (row["gen_gpus"], row["train_gpus"])
    assert all(c["gen_gpus"] + c["train_gpus"] <= 16 for c in cands)
    assert min(c["t_iter_s"] for c in cands) == pytest.approx(row["t_iter_s"])
    flat = sweep["flatness"]
    assert flat["near_gen_min"] <= row["gen_gpus"] <= flat["near_gen_max"] and flat["near_count"] >= 1
    _, cross = plan_cross_dc(small_estimator("H20", "H800"), 16, 8, sweep=True)
    assert any(c["chosen"] for c in cross["candidates"])


def test_plan_cli_prints_the_candidates_marks_the_choice_and_plots(tmp_path, capsys):
    from streamrl.cli import main

    png = tmp_path / "plan.png"
    assert main(["plan", "--model", "qwen2.5-7b", "--gpus", "16", "--max-len", "5000", "--batch", "256",
                 "--png", str(png)]) == 0
    text = capsys.readouterr().out
    assert "<- chosen" in text and "within 5% of the best" in text and png.stat().st_size > 1000

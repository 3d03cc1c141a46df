"""`streamrl profile` on a real tiny policy, and `streamrl simulate modes` on hand-made inputs."""

from __future__ import annotations

import json

import pytest

from streamrl.cli import main
from streamrl.scheduling.latency import load_profile

# A small workload so the real profile stays a few seconds on one thread.
SMALL = ["generation.prompts_per_iter=4", "generation.n_samples=2", "generation.max_new_tokens=24",
         "generation.threads_per_instance=1", "trainer.threads=1", "trainer.step_tokens=100", "task.num_eval=4"]


@pytest.mark.slow
def test_profile_writes_a_loadable_profile(tiny_policy_dir, tmp_path, capsys):
    out = tmp_path / "prof.json"
    rc = main(["profile", "configs/bench.yaml", f"policy.path={tiny_policy_dir}", *SMALL,
               "--batch-sizes", "4,1,2", "--new-tokens", "4", "--train-steps", "1", "--colocated-threads", "0",
               "--out", str(out)])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "ms_per_token" in printed and "tokens/s" in printed
    prof = load_profile(out)
    sizes = [b for b, _ in prof.points]
    assert sizes == [1, 2, 4]
    assert all(ms > 0 for _, ms in prof.points)
    assert prof.extra["train_tokens_per_s"] > 0
    assert prof.extra["threads"] == 1 and prof.extra["trainer_threads"] == 1
    assert prof.extra["params"] > 1000 and prof.extra["prompt_len_mean"] > 1
    assert len(prof.extra["sample_out_lens"]) == 8 and "colocated" not in prof.extra
    assert prof.kv_ms_per_token >= 0 and prof.extra["kv"]["batch_size"] == 4
    # prepare calls of 1, 2, 4 and all 8 units (PPO: samples), each timed, and the fitted call cost
    tr = prof.extra["train"]
    calls = tr["prepare_calls"]
    assert [c["units"] for c in calls] == [1] * 4 + [2] * 4 + [4] * 2 + [8]
    assert all(c["s"] > 0 and c["passes"] >= 1 and c["padded_tokens"] >= c["tokens"] for c in calls)
    assert tr["prepare_s_per_pass"] > 0 and tr["prepare_s_per_padded_token"] >= 0
    # the batched call of all 8 shares forward passes: fewer than 8 calls of one would run
    assert calls[-1]["passes"] < 8 * min(c["passes"] for c in calls if c["units"] == 1), calls
    assert "prepare calls" in printed


def test_profile_missing_policy_exits_2(tmp_path, capsys):
    missing = tmp_path / "no-policy"
    assert main(["profile", f"policy.path={missing}", "--out", str(tmp_path / "p.json")]) == 2
    err = capsys.readouterr().err
    assert "no policy checkpoint" in err and "make-policy" in err
    assert not missing.exists() and not (tmp_path / "p.json").exists()


PROFILE = {"engine": "transformers", "model": "tiny", "device": "cpu",
           "points": [{"batch_size": 1, "ms_per_token": 3.0}, {"batch_size": 8, "ms_per_token": 4.0},
                      {"batch_size": 64, "ms_per_token": 12.0}],
           "train_tokens_per_s": 3000.0, "threads": 1, "prompt_len_mean": 20.0}


def _bench(scale: float) -> dict:
    rows = [{"mode": m, "samples_per_s": 10.0 * scale, "tokens_per_s": 400.0 * scale, "step_s": 12.8 / scale,
             "gen_s": 5.0, "train_s": 7.0} for m in ("colocated", "disagg-batch", "stream-sync", "stream-async")]
    return {"rows": rows, "iterations": 4}


def test_simulate_modes_against_a_bench(tmp_path, capsys):
    prof, bench, out = tmp_path / "prof.json", tmp_path / "bench.json", tmp_path / "sim.json"
    prof.write_text(json.dumps(PROFILE))
    bench.write_text(json.dumps(_bench(1.0)))
    assert main(["simulate", "modes", "--profile", str(prof), "--bench", str(bench), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    rows = {r["mode"]: r for r in res["rows"]}
    assert set(rows) == {"colocated", "disagg-batch", "stream-sync", "stream-async"}
    for mode, r in rows.items():
        assert mode in printed
        assert r["sim_samples_per_s"] > 0
        assert r["sim_step_s"] == pytest.approx(128 / r["sim_samples_per_s"])
        assert r["ratio"] == pytest.approx(r["sim_samples_per_s"] / 10.0)
        assert r["within_20pct"] == ("yes" if abs(r["ratio"] - 1) <= 0.2 else "no")
        assert r["meas_mean_len"] == pytest.approx(40.0)
    assert rows["stream-async"]["sim_samples_per_s"] >= rows["stream-sync"]["sim_samples_per_s"] * 0.999
    assert rows["stream-sync"]["sim_samples_per_s"] >= rows["disagg-batch"]["sim_samples_per_s"] * 0.999
    assert res["assumptions"]["iterations"] == 4  # taken from the bench
    assert "reference solutions" in res["assumptions"]["lengths_source"]


def test_simulate_modes_within_flag_and_lengths_file(tmp_path):
    from streamrl.lab.sim import live

    lengths = tmp_path / "lens.jsonl"
    lengths.write_text("\n".join(json.dumps({"key": f"p{i}", "text": "x", "length": 30 + i % 5}) for i in range(50)))
    assert live.lengths_from_file(lengths)[:3] == [30.0, 31.0, 32.0]
    sim = live.simulate_tiny_modes(PROFILE, prompts_per_iter=8, n_samples=4, max_new_tokens=64,
                                   lengths=live.lengths_from_file(lengths), iterations=3)
    # A bench that measured exactly 1.1x the simulated throughput: every mode is within 20%.
    bench = {"rows": [{"mode": r["mode"], "samples_per_s": r["sim_samples_per_s"] / 1.1, "step_s": 1.0}
                      for r in sim["rows"]]}
    rows = live.compare_with_bench(sim["rows"], bench)
    assert [r["within_20pct"] for r in rows] == ["yes"] * 4
    assert all(r["ratio"] == pytest.approx(1.1) for r in rows)
    far = {"rows": [{"mode": "colocated", "samples_per_s": sim["rows"][0]["sim_samples_per_s"] * 2}]}
    rows = live.compare_with_bench(sim["rows"], far)
    assert rows[0]["within_20pct"] == "no" and rows[1]["within_20pct"] == "not measured"


def test_colocated_uses_the_bench_thread_scaling_without_2_thread_numbers():
    from streamrl.lab.sim import live

    kw = dict(prompts_per_iter=8, n_samples=4, max_new_tokens=64, lengths=[40.0] * 10, iterations=3,
              modes=["colocated", "disagg-batch"])
    plain = {r["mode"]: r for r in live.simulate_tiny_modes(PROFILE, **kw)["rows"]}
    # Same 1-thread rates in both; colocated also pays the measured weight install between stages.
    assert plain["colocated"]["sim_samples_per_s"] <= plain["disagg-batch"]["sim_samples_per_s"]
    assert plain["colocated"]["sim_samples_per_s"] == pytest.approx(plain["disagg-batch"]["sim_samples_per_s"], rel=1e-2)
    scaling = [{"threads": 1, "gen_tokens_per_s": 100.0, "train_tokens_per_s": 50.0},
               {"threads": 2, "gen_tokens_per_s": 200.0, "train_tokens_per_s": 100.0}]
    res = live.simulate_tiny_modes(PROFILE, thread_scaling=scaling, **kw)
    fast = {r["mode"]: r for r in res["rows"]}
    # twice as fast in both stages: about half the step time (the weight switch, milliseconds, stays)
    assert fast["colocated"]["sim_step_s"] == pytest.approx(plain["colocated"]["sim_step_s"] / 2, rel=1e-2)
    assert fast["colocated"]["sim_step_s"] > plain["colocated"]["sim_step_s"] / 2
    assert "thread_scaling" in res["assumptions"]["colocated_source"]
    prof2 = {**PROFILE, "colocated": {"threads": 2, "points": [{"batch_size": 1, "ms_per_token": 1.0}],
                                      "train_tokens_per_s": 1e6}}
    res = live.simulate_tiny_modes(prof2, thread_scaling=scaling, **kw)
    assert "profile 'colocated'" in res["assumptions"]["colocated_source"]


@pytest.mark.slow
def test_profile_times_each_stage_under_the_other_and_leaves_no_load_process(tiny_policy_dir, tmp_path):
    import subprocess

    out = tmp_path / "prof.json"
    assert main(["profile", "configs/bench.yaml", f"policy.path={tiny_policy_dir}", *SMALL, "--batch-sizes", "2,4",
                 "--new-tokens", "4", "--train-steps", "1", "--colocated-threads", "0", "--out", str(out)]) == 0
    ov = json.loads(out.read_text())["overlap"]
    assert ov["train_slowdown"] > 0 and ov["decode_slowdown"] > 0
    assert sorted(int(b) for b in ov["decode_slowdown_per_batch"]) == [2, 4]
    assert ov["train_under_decode"]["train_step_s"] > 0
    ps = subprocess.run(["ps", "-ww", "-eo", "args"], capture_output=True, text=True).stdout
    assert "streamrl.lab.profiling.overlap" not in ps  # both load processes were stopped


def test_simulate_modes_slows_only_the_overlapping_modes_by_the_profiled_interference():
    from streamrl.lab.sim.live import simulate_tiny_modes

    prof = {"points": [{"batch_size": 1, "ms_per_token": 2.0}, {"batch_size": 64, "ms_per_token": 4.0}],
            "train_tokens_per_s": 2000.0, "threads": 1, "prompt_len_mean": 20.0, "new_tokens": 32}
    kw = dict(prompts_per_iter=8, n_samples=4, max_new_tokens=48, lengths=[10, 20, 40], iterations=3)
    calm = {r["mode"]: r for r in simulate_tiny_modes(prof, **kw)["rows"]}
    busy = {r["mode"]: r for r in simulate_tiny_modes({**prof, "overlap": {"decode_slowdown": 1.5,
                                                                            "train_slowdown": 1.3}}, **kw)["rows"]}
    for mode in ("colocated", "disagg-batch"):
        assert busy[mode]["sim_samples_per_s"] == pytest.approx(calm[mode]["sim_samples_per_s"])
    for mode in ("stream-sync", "stream-async"):
        assert busy[mode]["sim_samples_per_s"] < 0.9 * calm[mode]["sim_samples_per_s"]
        assert busy[mode]["sim_gen_s"] > calm[mode]["sim_gen_s"]

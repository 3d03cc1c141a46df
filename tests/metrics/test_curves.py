"""`streamrl compare`: reward curves of finished runs, and the within-seed-noise verdict."""

import json

import pytest
import yaml

from streamrl.metrics.curves import compare, load_run, plot


def _run(tmp_path, name, mode, seed, rewards, before=0.3, after=0.5):
    d = tmp_path / name
    d.mkdir()
    (d / "config.yaml").write_text(yaml.safe_dump({"mode": mode, "run": {"seed": seed}}))
    lines = [{"step": 0, "eval/accuracy": before}]
    lines += [{"step": i + 1, "reward/mean": r} for i, r in enumerate(rewards)]
    lines.append({"step": len(rewards) + 1, "eval/accuracy": after})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return d


def test_load_run_reads_rewards_in_step_order_and_the_two_evaluations(tmp_path):
    run = load_run(_run(tmp_path, "a", "stream-sync", 1, [0.1, 0.2, 0.3], before=0.25, after=0.45))
    assert run["mode"] == "stream-sync" and run["seed"] == 1
    assert run["rewards"] == [0.1, 0.2, 0.3]
    assert (run["eval_before"], run["eval_after"]) == (0.25, 0.45)


def test_modes_agree_when_their_gap_is_within_the_seed_spread(tmp_path):
    runs = [load_run(_run(tmp_path, n, m, s, [0.3] * 6 + [v] * 3))
            for n, m, s, v in [("s0", "stream-sync", 0, 0.50), ("s1", "stream-sync", 1, 0.60),
                               ("a0", "stream-async", 0, 0.55), ("a1", "stream-async", 1, 0.58)]]
    res = compare(runs)
    assert res["seed_noise"] == pytest.approx(0.10)
    assert res["gap_between_modes"] == pytest.approx(0.015)
    assert res["modes_agree_within_seed_noise"] is True
    runs[2]["rewards"][-3:] = [0.9] * 3
    runs[3]["rewards"][-3:] = [0.95] * 3
    assert compare(runs)["modes_agree_within_seed_noise"] is False


def test_one_seed_per_mode_gives_no_verdict(tmp_path):
    runs = [load_run(_run(tmp_path, "s", "stream-sync", 0, [0.1, 0.2, 0.3])),
            load_run(_run(tmp_path, "a", "stream-async", 0, [0.1, 0.2, 0.3]))]
    assert compare(runs)["modes_agree_within_seed_noise"] is None


def test_bad_run_directories_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.yaml"):
        load_run(tmp_path)
    d = _run(tmp_path, "bad", "stream-sync", 0, [0.1])
    with open(d / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    with pytest.raises(ValueError, match=r"metrics.jsonl:4"):
        load_run(d)


def test_plot_writes_a_png(tmp_path):
    runs = [load_run(_run(tmp_path, "s", "stream-sync", 0, [0.1, 0.4, 0.2, 0.5, 0.6, 0.4]))]
    plot(runs, tmp_path / "curves.png", smooth=3)
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

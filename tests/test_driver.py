"""The RL driver end to end (colocated mode, tiny policy): metrics, checkpoint, resume."""

import json

from streamrl.config import load_config


def _cfg(policy_dir, out, *extra):
    return load_config(None, [f"policy.path={policy_dir}", f"run.out_dir={out}", "generation.max_new_tokens=24",
                              "generation.n_samples=2", "generation.prompts_per_iter=4", "task.num_eval=4",
                              "run.eval_samples=1", "cluster.num_cpus=2", *extra])


def test_colocated_run_logs_metrics_checkpoints_and_resumes(ray_session, tiny_policy_dir, tmp_path):
    from streamrl.controller.driver import train

    out = tmp_path / "run"
    lines = []
    summary = train(_cfg(tiny_policy_dir, out, "run.iterations=2"), echo=lines.append)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_iter = [r for r in records if "reward/mean" in r]
    assert len(per_iter) == 2
    for key in ("resp_len/p50", "resp_len/p90", "resp_len/max", "gen/tokens_per_s", "train/tokens_per_s",
                "time/gen_s", "time/train_s"):
        assert key in per_iter[0], key
    assert sum(1 for line in lines if line.startswith("iter")) == 2  # one console line per iteration
    assert list((out / "tensorboard").iterdir())
    assert (out / "checkpoint" / "trainer.pt").is_file() and (out / "checkpoint" / "policy" / "config.json").is_file()
    assert "eval/accuracy" in summary["before"] and "eval/accuracy" in summary["after"]

    lines.clear()
    train(_cfg(tiny_policy_dir, out, "run.iterations=3", "run.resume=true"), echo=lines.append)
    assert any("resumed" in line and "iteration 2" in line for line in lines)
    assert sum(1 for line in lines if line.startswith("iter")) == 1  # only the third iteration ran

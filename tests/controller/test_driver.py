"""The RL driver end to end (colocated mode, tiny policy): metrics, checkpoint, resume."""

import json

import pytest

from streamrl.config import load_config

pytestmark = pytest.mark.slow  # Ray, engines and the trainer: a whole training run


def _cfg(policy_dir, out, *extra):
    return load_config(None, [f"policy.path={policy_dir}", f"run.out_dir={out}", "generation.max_new_tokens=24",
                              "generation.n_samples=2", "generation.prompts_per_iter=4", "task.num_eval=4",
                              "run.eval_samples=1", "cluster.num_cpus=2", *extra])


def test_colocated_run_logs_metrics_checkpoints_and_resumes(ray_session, tiny_policy_dir, tmp_path):
    from streamrl.controller.driver import train

    out = tmp_path / "run"
    lines = []
    # 4 training prompts, 4 per iteration: every iteration is a new epoch over the same prompts
    summary = train(_cfg(tiny_policy_dir, out, "run.iterations=2", "task.num_train=4", "logging.samples=true",
                         "run.checkpoint_every=1", "run.keep_checkpoints=true"), echo=lines.append)
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
    assert set(summary["peak_memory_mb"]) == {"colocated-0", "driver"}

    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4 * 2  # iterations x prompts x samples: every trained sample, once
    assert [r["epoch"] for r in rows] == [r["iteration"] for r in rows]  # the k-th visit of each prompt
    assert {(r["iteration"], r["key"], r["sample_idx"]) for r in rows} == {
        (it, k, i) for it in (0, 1) for k in {r["key"] for r in rows} for i in (0, 1)}
    assert all(r["length"] >= 1 and r["text"] and r["finish_reason"] in ("stop", "length") for r in rows)
    assert all(r["logprob"] < 0 for r in rows)  # the behaviour policy's log-prob of the whole response
    # ... and token by token: one per response token, summing to it
    assert all(len(r["logprobs"]) == r["length"] and sum(r["logprobs"]) == pytest.approx(r["logprob"], abs=1e-4)
               for r in rows)
    assert all(len(r["output_ids"]) == r["length"] for r in rows)  # the generated ids, EOS included
    # every periodic checkpoint's policy is kept beside the latest (the reweighted ranker's eval reads them)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter-1", "iter-2"]
    assert (out / "checkpoints" / "iter-1" / "config.json").is_file()

    # a row written after the checkpoint (iteration 2 of a crashed run) is dropped on resume
    with open(out / "samples.jsonl", "a") as f:
        f.write(json.dumps({**rows[0], "iteration": 2, "epoch": 2, "length": 999}) + "\n")
    lines.clear()
    train(_cfg(tiny_policy_dir, out, "run.iterations=3", "run.resume=true", "task.num_train=4", "logging.samples=true"),
          echo=lines.append)
    assert any("resumed" in line and "iteration 2" in line for line in lines)
    assert sum(1 for line in lines if line.startswith("iter")) == 1  # only the third iteration ran
    resumed = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert resumed[:16] == rows and len(resumed) == 24
    assert {r["epoch"] for r in resumed[16:]} == {2} and 999 not in [r["length"] for r in resumed[16:]]

    from streamrl.ranker.records import load_samples_jsonl

    records = load_samples_jsonl(out / "samples.jsonl", step_field="epoch")  # `rank eval` reads the log as it is
    assert sorted({r.step for r in records}) == [0, 1, 2] and len(records) == 24

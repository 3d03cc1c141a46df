"""The real GSM8K file with a reward named by path: the reference solution scores 1, a wrong
answer 0 (through the isolated reward workers), and a short stream-async run on the file trains
with it and counts every row it read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.helpers import make_qwen2_bpe_checkpoint
from streamrl.config import TaskConfig
from streamrl.tasks.base import default_data_dir
from streamrl.tasks.math import MathTask
from streamrl.tasks.rewards import RewardRunner
from streamrl.tasks.user_reward import UserReward

SPEC = "streamrl.tasks.math:verify"


def gsm8k_file() -> Path:
    path = default_data_dir() / "gsm8k_test.jsonl"
    if not path.is_file():
        pytest.skip(f"../shared/data not found: {path} (set STREAMRL_DATA_DIR)")
    return path


def test_reference_solution_scores_one_and_a_wrong_answer_zero_by_path():
    path = gsm8k_file()
    raw = [json.loads(line) for line in path.read_text().splitlines()]
    task = MathTask.from_config(TaskConfig(name="gsm8k", train_path=str(path), num_train=10, num_eval=10), seed=0)
    by_question = {r["question"]: r["answer"] for r in raw}
    prompts = [p for p in task.train_prompts() + task.eval_prompts() if p.meta["problem"] in by_question][:6]
    assert prompts
    with RewardRunner(UserReward([SPEC]), timeout_s=30.0) as runner:
        for p in prompts:
            reference = by_question[p.meta["problem"]]  # the dataset's own worked solution, '#### N'
            assert runner(p, reference)[0] == 1.0
            assert runner(p, f"The answer is \\boxed{{{int(p.answer) + 1}}}.")[0] == 0.0
        assert runner.metrics()["reward/errors"] == 0


@pytest.mark.slow
def test_short_stream_async_run_on_gsm8k_with_the_reward_by_path(ray_session, tmp_path):
    from streamrl.config import load_config
    from streamrl.controller.driver import train

    path = gsm8k_file()
    questions = [json.loads(line)["question"] for line in path.read_text().splitlines()[:300]]
    ckpt = tmp_path / "qwen-bpe"
    make_qwen2_bpe_checkpoint(ckpt, questions, vocab_size=600)
    out = tmp_path / "run"
    cfg = load_config(None, [
        "mode=stream-async", f"policy.path={ckpt}", "task.name=gsm8k", f"task.reward={SPEC}", "task.num_train=8",
        "task.num_eval=4", "run.eval_samples=1", "run.iterations=2", f"run.out_dir={out}",
        "generation.prompts_per_iter=2", "generation.n_samples=2", "generation.max_new_tokens=12",
        "logging.backends=[jsonl]", "ranker.name=none"])
    summary = train(cfg, echo=lambda line: None)
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    per_iter = [r for r in records if "reward/mean" in r]
    assert len(per_iter) == 2 and all(r["reward/errors"] == 0 and r["batch/samples"] == 4 for r in per_iter)
    assert per_iter[-1]["reward/calls"] == 4 + 2 * 4  # held-out before + two iterations of 4 samples
    assert (Path(summary["final_policy"]) / "model.safetensors").is_file()

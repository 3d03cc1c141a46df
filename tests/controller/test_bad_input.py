"""Prompts that cannot fit are dropped when the data is loaded, counted and named; a run whose
every prompt is too long stops with one line before any work (no batch is ever empty)."""

from __future__ import annotations

import json

import pytest

from streamrl.config import load_config


def _setup(tmp_path, n_short: int, n_long: int, context: int = 64):
    from streamrl.models.tiny import build_tokenizer

    pol = tmp_path / "policy"
    build_tokenizer(["0123456789 +="]).save_pretrained(pol)  # one token per character
    (pol / "config.json").write_text(json.dumps({"model_type": "qwen2", "max_position_embeddings": context}))
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(n_short)]
    rows += [{"prompt": "1" * 40 + f"+{i}=", "answer": "0"} for i in range(n_long)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return pol, data


def _usable(pol, data, *overrides):
    from transformers import PreTrainedTokenizerFast

    from streamrl.controller.common import RequestBuilder
    from streamrl.controller.prompts import usable_prompts
    from streamrl.tasks.factory import make_task

    cfg = load_config(None, [f"policy.path={pol}", "task.name=file", f"task.train_path={data}", "task.num_eval=2",
                             "task.chat_template=none", *overrides])
    builder = RequestBuilder(PreTrainedTokenizerFast.from_pretrained(pol), cfg)
    return usable_prompts(cfg, make_task(cfg), builder)


def test_prompts_over_the_limit_are_dropped_at_load_and_counted(tmp_path, caplog):
    pol, data = _setup(tmp_path, n_short=10, n_long=3)
    train, evals, metrics = _usable(pol, data, "task.max_prompt_tokens=20", "generation.max_new_tokens=8")
    assert all(len(p.text) <= 20 for p in train + evals) and len(train) + len(evals) == 10
    assert metrics["data/oversized"] == 3.0 and metrics["data/prompt_token_limit"] == 20.0
    assert sum("tokens > 20 (task.max_prompt_tokens=20): not used" in r.message for r in caplog.records) == 3


def test_the_policy_context_bounds_prompt_plus_response(tmp_path):
    pol, data = _setup(tmp_path, n_short=10, n_long=3)
    # 64-token context - 40 new tokens leaves 24 for the prompt, below task.max_prompt_tokens=256
    _, _, metrics = _usable(pol, data, "generation.max_new_tokens=40")
    assert metrics["data/prompt_token_limit"] == 24.0 and metrics["data/oversized"] == 3.0


def test_a_task_whose_every_prompt_is_too_long_stops_naming_the_limit(tmp_path):
    from streamrl.tasks.math import DataError

    pol, data = _setup(tmp_path, n_short=0, n_long=6)
    with pytest.raises(DataError, match=r"every training prompt \(\d\) is longer than 20 tokens \(task.max_prompt_tokens=20\)"):
        _usable(pol, data, "task.max_prompt_tokens=20", "generation.max_new_tokens=8")
    with pytest.raises(DataError, match="leaves no room for a prompt"):
        _usable(pol, data, "generation.max_new_tokens=64")


def test_the_rollout_log_flags_an_errored_reward(tmp_path):
    from streamrl.metrics.samples import SampleLog
    from streamrl.types import Completion, Prompt, Sample

    prompt = Prompt("p0", "1+1=", "2", {})
    c = Completion("0:p0/0", "p0", 0, (1, 2), (3,), (-0.5,), "stop", 0, 0, 0.0, 1.0, "gen-0")
    samples = [Sample(prompt=prompt, sample_idx=0, completion=c, response_text="2", reward=0.0,
                      reward_info={"error": "ZeroDivisionError: division by zero"}, iteration=0),
               Sample(prompt=prompt, sample_idx=1, completion=c, response_text="3", reward=0.0, reward_info={},
                      iteration=0)]
    log = SampleLog(tmp_path)
    log.write(0, samples)
    log.close()
    rows = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["reward_error"] for r in rows] == ["ZeroDivisionError: division by zero", None]

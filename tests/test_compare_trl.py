"""scripts/compare_trl.py without TRL: the inputs both systems read and the table's arithmetic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def compare():
    spec = importlib.util.spec_from_file_location("compare_trl", ROOT / "scripts" / "compare_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_both_systems_read_one_prompt_file_and_one_reward_in_their_own_conventions(compare, tmp_path):
    paths = compare.write_inputs(tmp_path, seed=0, num_train=64)
    rows = [json.loads(line) for line in Path(paths["train"]).read_text().splitlines()]
    assert len(rows) == 64 and all(set(r) == {"question", "answer"} for r in rows)
    held_out = {json.loads(line)["question"] for line in Path(paths["eval"]).read_text().splitlines()}
    assert not held_out & {r["question"] for r in rows}
    spec = importlib.util.spec_from_file_location("reward", paths["reward"])
    reward = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reward)
    answer = rows[0]["answer"]
    # streamrl's positional call and TRL's keyword-list call agree, conversational or plain
    assert reward.correct(f"so it is {answer}", answer, "", {}) == 1.0
    assert reward.correct(f"{answer} or 1234567", answer, "", {}) == 0.0
    assert reward.trl_correct([[{"role": "assistant", "content": f"= {answer}"}], "no number"],
                              answer=[answer, answer]) == [1.0, 0.0]


def test_the_table_compares_medians_and_averages_rewards_by_step(compare):
    runs = [{"system": "trl", "samples_per_s": r, "rl_seconds": 64 / r, "rewards": [0.0, 0.5]} for r in (1.0, 2.0, 4.0)]
    runs += [{"system": "stream-async", "samples_per_s": r, "rl_seconds": 64 / r, "rewards": [0.5, 1.0, 1.0]}
             for r in (3.0, 5.0, 4.0)]
    table = {row["system"]: row for row in compare.summarize(runs, ["trl", "stream-async"])}
    assert table["trl"]["vs_trl"] == 1.0 and table["stream-async"]["vs_trl"] == 2.0  # 4 / 2, medians
    assert (table["stream-async"]["samples_per_s_min"], table["stream-async"]["samples_per_s_max"]) == (3.0, 5.0)
    assert table["trl"]["reward_by_step"] == [0.0, 0.5] and table["stream-async"]["rl_seconds_median"] == 16.0

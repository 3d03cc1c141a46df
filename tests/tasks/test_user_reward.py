"""A user's reward function: by path or as a callable, weights and components, through the
isolated reward workers, with clear errors for bad specs."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamrl.tasks.rewards import RewardRunner
from streamrl.tasks.user_reward import RewardSpecError, UserReward, load_reward_function
from streamrl.types import Prompt

REWARD_FILE = '''
def exact(response, answer, prompt, metadata):
    return 1.0 if response.strip() == answer else 0.0

def parts(response, answer, prompt, metadata):
    return {"format": 0.5 if response.startswith("A:") else 0.0, "length": -0.01 * len(response)}

def scored(response, answer, prompt, metadata):
    return {"score": 2.0, "aux": 7.0}

def boom(response, answer, prompt, metadata):
    raise RuntimeError("reward exploded on " + metadata["topic"])

def two_args(response, answer):
    return 0.0
'''


@pytest.fixture
def reward_file(tmp_path: Path) -> Path:
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return path


PROMPT = Prompt("p-1", "What is 2+2?", "4", {"topic": "add", "line": 3})


def test_spec_by_file_path_weights_and_components(reward_file: Path) -> None:
    r = UserReward([f"{reward_file}:exact", f"{reward_file}:parts"], weights=[1.0, 2.0])
    score, comps = r(PROMPT, "4")
    assert score == pytest.approx(1.0 + 2.0 * (0.0 - 0.01))
    assert comps == {"exact": 1.0, "parts/format": 0.0, "parts/length": pytest.approx(-0.01), "parts": pytest.approx(-0.01)}
    score, comps = UserReward([f"{reward_file}:scored"])(PROMPT, "x")
    assert score == 2.0 and comps == {"score": 2.0, "aux": 7.0}


def test_relative_file_spec_resolves_against_the_config_directory(reward_file: Path) -> None:
    fn = load_reward_function("my_reward.py:exact", base_dir=reward_file.parent)
    assert fn("4", "4", "", {}) == 1.0


def test_module_spec_imports_by_dotted_name(reward_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(reward_file.parent))
    assert load_reward_function("my_reward:exact")("4", "4", "", {}) == 1.0
    with pytest.raises(RewardSpecError, match="must accept \\(response, answer, prompt, metadata\\)"):
        load_reward_function("streamrl.tasks.user_reward:combine")  # a real function, wrong signature


@pytest.mark.parametrize("spec, message", [
    ("no_colon_here", "is not 'package.module:function'"),
    ("/nope/missing.py:f", "does not exist"),
    ("streamrl.no_such_module:f", "importing 'streamrl.no_such_module' failed: ModuleNotFoundError"),
])
def test_bad_specs_fail_naming_the_spec(spec: str, message: str) -> None:
    with pytest.raises(RewardSpecError, match=message):
        UserReward([spec]).check()


def test_missing_function_and_wrong_signature_name_the_spec(reward_file: Path) -> None:
    with pytest.raises(RewardSpecError, match=r"has no 'exactt' \(callables there: \['boom', 'exact'"):
        load_reward_function(f"{reward_file}:exactt")
    with pytest.raises(RewardSpecError, match="two_args.*must accept"):
        load_reward_function(f"{reward_file}:two_args")


def test_user_reward_runs_in_isolated_workers_with_components_and_error_accounting(reward_file: Path) -> None:
    with RewardRunner(UserReward([f"{reward_file}:parts"]), timeout_s=20.0) as runner:
        score, info = runner(PROMPT, "A: 4")
        assert score == pytest.approx(0.5 - 0.04) and info["components"]["format"] == 0.5
    with RewardRunner(UserReward([f"{reward_file}:boom"]), timeout_s=20.0) as runner:
        score, info = runner(PROMPT, "4")
        assert score == 0.0 and "reward exploded on add" in info["error"]
        assert runner.metrics()["reward/errors"] == 1.0


def test_a_closure_from_the_callers_scope_travels_to_the_worker_by_cloudpickle() -> None:
    target = "4"

    def close_enough(response, answer, prompt, metadata):
        return 1.0 if target in response and metadata["line"] == 3 else 0.0

    with RewardRunner(UserReward(fns=[close_enough]), timeout_s=20.0) as runner:
        assert runner(PROMPT, "it is 4")[0] == 1.0
        assert runner(PROMPT, "it is 5")[0] == 0.0


def test_non_numeric_return_counts_as_an_error() -> None:
    def bad(response, answer, prompt, metadata):
        return "yes"

    runner = RewardRunner(UserReward(fns=[bad]), fast=True)
    score, info = runner(PROMPT, "4")
    assert score == 0.0 and "not a number" in info["error"]

"""RewardRunner: fast and isolated paths, error/timeout accounting, raise mode, real math rewards."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time

import pytest

from streamrl.config import TaskConfig
from streamrl.tasks.base import default_data_dir
from streamrl.tasks.math import MathTask, math_reward
from streamrl.tasks.rewards import RewardError, RewardRunner
from streamrl.types import Prompt

PROMPT = Prompt("p-000007", "What is 2+3?", "5")


# Module-level so the isolated workers (spawned processes) can unpickle them.
def exact_reward(prompt: Prompt, response: str) -> float:
    return 1.0 if response.strip() == prompt.answer else 0.0


def raising_reward(prompt: Prompt, response: str) -> float:
    raise KeyError(f"boom on {response!r}")


def hanging_reward(prompt: Prompt, response: str) -> float:
    """``"hang:<path>"`` writes this worker's pid to ``path``, then hangs for a minute."""
    if response.startswith("hang"):
        if ":" in response:
            with open(response.split(":", 1)[1], "w") as f:
                f.write(str(os.getpid()))
        time.sleep(60)
    return exact_reward(prompt, response)


def dying_reward(prompt: Prompt, response: str) -> float:
    if response == "die":
        os._exit(3)
    return exact_reward(prompt, response)


def nan_reward(prompt: Prompt, response: str) -> float:
    return float("nan")


def barrier_reward(prompt: Prompt, response: str) -> float:
    """``"<dir>:<n>"``: marks its start in ``dir``, then waits (up to a minute) until ``n`` calls
    have started: 1.0 only if ``n`` calls ran at the same time. Reports its process id."""
    folder, n = response.rsplit(":", 1)
    open(os.path.join(folder, f"started-{os.getpid()}-{time.monotonic_ns()}"), "w").close()
    deadline = time.monotonic() + 60
    while len(os.listdir(folder)) < int(n) and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"score": float(len(os.listdir(folder)) >= int(n)), "pid": float(os.getpid())}


def test_fast_path_scores_in_process_with_empty_info() -> None:
    runner = RewardRunner(exact_reward, fast=True)
    assert runner(PROMPT, "5") == (1.0, {})
    assert runner(PROMPT, "6") == (0.0, {})
    m = runner.metrics()
    assert m["reward/calls"] == 2.0 and m["reward/errors"] == 0.0 and m["reward/timeouts"] == 0.0


def test_fast_path_counts_exception_as_zero_with_error_info(caplog: pytest.LogCaptureFixture) -> None:
    runner = RewardRunner(raising_reward, fast=True, on_error="zero")
    with caplog.at_level(logging.WARNING):
        reward, info = runner(PROMPT, "x")
    assert reward == 0.0 and info["error"].startswith("KeyError: ") and "boom" in info["error"]
    assert runner.metrics()["reward/errors"] == 1.0
    assert any("p-000007" in r.getMessage() for r in caplog.records)


def test_fast_path_raise_mode_names_prompt_and_exception() -> None:
    runner = RewardRunner(lambda p, r: 1 / 0, fast=True, on_error="raise")
    with pytest.raises(RewardError, match=r"'p-000007' failed: ZeroDivisionError"):
        runner(PROMPT, "x")


def test_fast_path_calls_the_reward_once_per_call_in_the_callers_thread_and_starts_no_worker(monkeypatch) -> None:
    def no_process(*args, **kwargs):
        raise AssertionError("the fast path started a worker process")

    monkeypatch.setattr(subprocess, "Popen", no_process)  # what every isolated worker is started with
    calls = []

    def counted(prompt: Prompt, response: str) -> float:  # a closure: only the fast path accepts it
        calls.append(threading.get_ident())
        return exact_reward(prompt, response)

    runner = RewardRunner(counted, fast=True)
    assert [runner(PROMPT, "5") for _ in range(100)] == [(1.0, {})] * 100
    assert calls == [threading.get_ident()] * 100  # in this thread, no retry, no extra call
    assert runner.metrics()["reward/calls"] == 100.0 and runner.metrics()["reward/worker_restarts"] == 0.0


def test_non_finite_reward_is_a_counted_error() -> None:
    reward, info = RewardRunner(nan_reward, fast=True)(PROMPT, "5")
    assert reward == 0.0 and "not finite" in info["error"]


def test_options_are_validated_loudly() -> None:
    with pytest.raises(ValueError, match="on_error must be 'zero' or 'raise', got 'ignore'"):
        RewardRunner(exact_reward, on_error="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="timeout_s must be > 0, got 0"):
        RewardRunner(exact_reward, timeout_s=0)
    import threading

    lock = threading.Lock()  # a lambda pickles by value now (cloudpickle); a lock held by one never does
    with pytest.raises(ValueError, match="not picklable"):
        RewardRunner(lambda p, r: float(lock.locked()))


def test_isolated_reward_that_raises_is_counted_zero_then_raised_in_raise_mode() -> None:
    with RewardRunner(raising_reward, timeout_s=5.0) as runner:
        reward, info = runner(PROMPT, "x")
        assert reward == 0.0 and "KeyError" in info["error"] and "boom" in info["error"]
        assert runner.metrics()["reward/errors"] == 1.0 and runner.metrics()["reward/worker_restarts"] == 0.0
        runner.on_error = "raise"
        with pytest.raises(RewardError, match=r"prompt 'p-000007' failed: KeyError"):
            runner(PROMPT, "x")


def test_hanging_reward_times_out_and_its_worker_is_killed_and_replaced(tmp_path) -> None:
    import psutil

    pid_file = tmp_path / "pid"
    with RewardRunner(hanging_reward, timeout_s=1.0) as runner:
        assert runner(PROMPT, "5") == (1.0, {})  # worker started (startup is not timed)
        reward, info = runner(PROMPT, f"hang:{pid_file}")  # waited out, it would score 0.0 with {}
        assert reward == 0.0 and info == {"error": "timeout after 1.0s"}
        hung = int(pid_file.read_text())
        # killed and reaped before the call returned, not left sleeping (the pid is gone, or a zombie's)
        assert not psutil.pid_exists(hung) or psutil.Process(hung).status() == psutil.STATUS_ZOMBIE
        assert runner(PROMPT, "5") == (1.0, {})  # a fresh worker answers
        m = runner.metrics()
        assert (m["reward/calls"], m["reward/errors"], m["reward/timeouts"], m["reward/worker_restarts"]) == (3, 1, 1, 1)


def test_hanging_reward_in_raise_mode_names_prompt_and_timeout() -> None:
    with RewardRunner(hanging_reward, timeout_s=0.5, on_error="raise") as runner:
        runner(PROMPT, "5")
        with pytest.raises(RewardError, match=r"'p-000007' failed: timeout after 0.5s"):
            runner(PROMPT, "hang")


def test_worker_that_dies_is_counted_and_replaced() -> None:
    with RewardRunner(dying_reward, timeout_s=5.0) as runner:
        reward, info = runner(PROMPT, "die")
        assert reward == 0.0 and "reward worker died" in info["error"] and "exit code 3" in info["error"]
        assert runner(PROMPT, "5") == (1.0, {})
        assert runner.metrics()["reward/worker_restarts"] == 1.0


def test_math_task_reward_runs_isolated_from_non_main_threads() -> None:
    path = default_data_dir() / "gsm8k_test.jsonl"
    if not path.is_file():
        pytest.skip(f"../shared/data not found: {path} (set STREAMRL_DATA_DIR)")
    task = MathTask(path, name="gsm8k", num_train=8, num_eval=4)
    cfg = TaskConfig(name="gsm8k", reward_timeout_s=10.0)
    prompts = task.train_prompts()
    results: dict[str, tuple[float, float, dict]] = {}

    def score(p: Prompt) -> None:
        right = runner(p, f"The answer is \\boxed{{{p.answer}}}.")
        garbage = runner(p, "{" * 10_000)
        results[p.prompt_id] = (right[0], garbage[0], garbage[1])

    with RewardRunner.for_task(task, cfg, num_workers=2) as runner:
        threads = [threading.Thread(target=score, args=(p,)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert runner.metrics()["reward/errors"] == 0.0
    assert sorted(results) == sorted(p.prompt_id for p in prompts)
    assert all(r == (1.0, 0.0, {}) for r in results.values()), results
    assert all(math_reward(p, str(int(float(p.answer)) + 1)) == 0.0 for p in prompts)


def test_runner_works_in_a_script_without_main_guard_and_exits_cleanly() -> None:
    # Under multiprocessing spawn, a worker would re-run this unguarded script (and fail on stdin).
    script = (
        "from streamrl.tasks.math import math_reward\n"
        "from streamrl.tasks.rewards import RewardRunner\n"
        "from streamrl.types import Prompt\n"
        "runner = RewardRunner(math_reward, timeout_s=10)\n"
        "p = Prompt('q-1', 'What is half of 1?', '\\\\frac{1}{2}')\n"
        "print(runner(p, 'so \\\\boxed{0.5}'), runner(p, '\\\\boxed{2}'))\n"
    )
    out = subprocess.run([sys.executable, "-"], input=script, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "(1.0, {}) (0.0, {})", out.stdout + out.stderr


def test_submitted_calls_run_at_once_one_per_worker_process(tmp_path) -> None:
    """``num_workers`` calls score at the same time, each in its own worker process (a reward
    that waits for all of them to start scores 1.0 only then)."""
    with RewardRunner(barrier_reward, timeout_s=90.0, num_workers=3) as runner:
        futures = [runner.submit(PROMPT, f"{tmp_path}:3") for _ in range(3)]
        results = [f.result() for f in futures]
        assert [r[0] for r in results] == [1.0, 1.0, 1.0]
        assert len({r[1]["components"]["pid"] for r in results}) == 3
        assert runner.metrics()["reward/calls"] == 3.0
    with RewardRunner(exact_reward, fast=True) as fast:
        assert fast.submit(PROMPT, "5").result() == (1.0, {})  # a fast runner scores at once

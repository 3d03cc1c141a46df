"""Environments run in isolated worker processes: state kept per trajectory, replayed after a
worker is killed for another trajectory's hang, errors and hangs reported, tools answered."""

from __future__ import annotations

import textwrap

from streamrl.agent.env import EnvHost
from streamrl.agent.runner import EnvRunner

ENV = textwrap.dedent('''
    import time

    class Counter:
        """Answers each step with how many steps it has taken; 'hang' hangs, 'boom' raises."""

        def __init__(self, row):
            self.row, self.steps = row, 0

        def reset(self):
            return f"start {self.row['prompt']}"

        def step(self, text):
            if text == "hang":
                time.sleep(60)
            if text == "boom":
                raise ValueError("broken env")
            self.steps += 1
            done = self.steps >= 3
            return (None if done else f"step {self.steps}"), 0.5, done

    def add(a: int, b: int) -> int:
        """Add.

        Args:
            a: first
            b: second
        """
        return a + b
''')


def _runner(tmp_path, tools=(), workers=1, timeout_s=1.0):
    path = tmp_path / "envs.py"
    path.write_text(ENV)
    host = EnvHost(f"{path}:Counter", [f"{path}:{t}" for t in tools])
    return EnvRunner(host, workers=workers, timeout_s=timeout_s)


def test_a_trajectory_keeps_its_env_and_a_killed_worker_replays_the_others(tmp_path):
    runner = _runner(tmp_path)
    row = {"prompt": "p", "answer": "a", "prompt_id": "x"}
    try:
        assert runner.submit("t1", "reset", row, []).result() == ("ok", {"messages": [{"role": "user", "content": "start p"}]})
        kind, out = runner.submit("t1", "step", row, ["a"]).result()
        assert kind == "ok" and out["messages"][0]["content"] == "step 1" and out["reward"] == 0.5 and not out["done"]
        runner.submit("t2", "reset", row, []).result()
        assert runner.submit("t2", "step", row, ["hang"]).result() == ("timeout", None)  # its worker is killed
        kind, out = runner.submit("t1", "step", row, ["a", "b"]).result()  # t1's env is rebuilt by replay
        assert kind == "ok" and out["messages"][0]["content"] == "step 2"
        kind, out = runner.submit("t1", "step", row, ["a", "b", "c"]).result()
        assert kind == "ok" and out["done"] and out["messages"] == []
        kind, message = runner.submit("t3", "step", row, ["boom"]).result()
        assert kind == "error" and "ValueError: broken env" in message
        assert runner.counts["timeouts"] == 1 and runner.counts["errors"] == 1 and runner.counts["worker_restarts"] == 1
    finally:
        runner.close()


def test_tool_calls_are_answered_without_stepping_the_env(tmp_path):
    runner = _runner(tmp_path, tools=["add"])
    row = {"prompt": "p", "answer": "a", "prompt_id": "x"}
    try:
        runner.submit("t", "reset", row, []).result()
        kind, out = runner.submit("t", "step", row, ['<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}'
                                                     '</tool_call><tool_call>oops</tool_call>']).result()
        assert kind == "ok" and not out["env_step"] and out["tool_calls"] == 2 and out["tool_errors"] == 1
        assert [m["content"] for m in out["messages"]][1] == "5"
        kind, out = runner.submit("t", "step", row, ["the answer"]).result()  # no call: the env's turn, its first step
        assert out["env_step"] and out["messages"][0]["content"] == "step 1"
    finally:
        runner.close()


def test_the_readme_environment_runs_under_the_contract(tmp_path):
    import re
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    code = re.search(r"```python\n(class Guess.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 11
    (tmp_path / "my_env.py").write_text(code)
    host = EnvHost(f"{tmp_path / 'my_env.py'}:Guess", [])
    row = {"prompt": "p", "answer": "42", "prompt_id": "x"}
    assert "2 digits" in host("reset", "t", row, [])["messages"][0]["content"]
    wrong = host("step", "t", row, ["7"])
    assert wrong["messages"] == [{"role": "user", "content": "No, try again."}] and not wrong["done"]
    right = host("step", "t", row, ["7", "it is 42"])
    assert right == {"messages": [], "reward": 0.5, "done": True, "env_step": True}


def test_a_bad_env_or_tool_stops_the_cli_in_one_line_naming_it(tmp_path):
    import subprocess
    import sys

    (tmp_path / "tools.py").write_text("def bare(a, b):\n    return a\n")
    cases = [(["task.env=missing_env.py:Nope"], "task.env='"),  # a run
             ([f"task.tools=[{tmp_path / 'tools.py'}:bare]", "--dry-run"], "task.tools entry")]  # a dry run
    for overrides, named in cases:
        proc = subprocess.run([sys.executable, "-m", "streamrl.cli", "train", "mode=stream-async",
                               f"run.out_dir={tmp_path / 'run'}", *overrides],
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert named in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "run").exists()  # refused before the run directory

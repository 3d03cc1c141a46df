"""One stream-async run SIGKILLed (the driver and all of Ray under it) at three random points and
resumed each time: checked against the uninterrupted schedule for exactly-once training (the
final weights' lineage) and for the staleness bound (every logged sample's version)."""

from __future__ import annotations

import json
import os
import random
import sys
import time
from pathlib import Path

import pytest

from streamrl.config import load_config

pytestmark = pytest.mark.slow  # four CLI runs on Ray

ROOT = Path(__file__).parents[2]
ITERATIONS = 12  # the three kills each land after the attempt's first logged iteration


def test_a_run_killed_and_resumed_three_times_trains_the_schedule_exactly_once(tiny_policy_dir, tmp_path):
    from streamrl.lab.bench.faults import Attempt, _kill_tree, _wait_gone, exactly_once, scheduled_ids

    overrides = [f"policy.path={tiny_policy_dir}", "mode=stream-async", f"run.iterations={ITERATIONS}",
                 "generation.prompts_per_iter=4", "generation.n_samples=2", "generation.max_new_tokens=24",
                 "task.num_eval=4", "run.eval_samples=1", "cluster.num_cpus=2", "run.checkpoint_every=1",
                 "logging.samples=true", "logging.backends=[console,jsonl]"]
    out = tmp_path / "run"
    base = [sys.executable, "-m", "streamrl.cli", "train", *overrides, f"run.out_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    rng, kills = random.Random(0), 0
    for k in range(3):
        resume = (out / "checkpoint" / "trainer.pt").is_file()
        att = Attempt(base + (["run.resume=true"] if resume else ["run.overwrite=true"]), tmp_path / f"a{k}.log", env)
        deadline = time.time() + 180
        while time.time() < deadline and att.proc.poll() is None and not any(
                line.startswith("iter") for _, line in att.lines):
            time.sleep(0.05)
        if att.proc.poll() is not None:  # it finished (or failed) before it could be killed
            break
        time.sleep(rng.uniform(0.0, 0.5))  # a random point after its first iteration
        _wait_gone(_kill_tree(att.proc.pid))
        att.finish()
        kills += 1
    final = Attempt(base + ["run.resume=true"], tmp_path / "final.log", env)
    assert final.finish() == 0, "\n".join(line for _, line in final.lines[-20:])
    assert kills >= 3

    cfg = load_config(None, overrides)
    check = exactly_once(scheduled_ids(cfg), json.loads((out / "lineage.json").read_text()))
    assert check["prompts_lost"] == 0 and check["prompts_trained_twice"] == 0, check
    assert check["samples_trained"] == ITERATIONS * 4 * 2
    rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted({r["iteration"] for r in rows}) == list(range(ITERATIONS)) and len(rows) == ITERATIONS * 4 * 2
    assert all(0 <= r["iteration"] - r["version_start"] <= 1 for r in rows)  # stream-async's bound

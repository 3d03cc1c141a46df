"""Ctrl-C on `streamrl train` (a real SIGINT to the CLI process) in stream-async: the run stops
with a checkpoint of the last finished iteration, and the resumed run trains each remaining
iteration once, so the logs hold every iteration exactly once.

The CLI runs under a wrapper that holds the run right after it logs iteration 3, until the
signal comes: the interrupt lands inside the loop, at a point the run cannot have passed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two CLI runs on Ray

ROOT = Path(__file__).parents[2]


HOLD_AFTER_STEP_3 = """
import signal, sys, time
from streamrl.metrics import logger

# Ctrl-C as at a terminal: a shell that starts jobs in the background without job control gives
# them SIGINT ignored, and Python then keeps it ignored (the run would never see the interrupt).
signal.signal(signal.SIGINT, signal.default_int_handler)

log = logger.MetricsLogger.log

def held(self, step, metrics, echo=True):
    log(self, step, metrics, echo)
    if step == 3 and "reward/mean" in metrics:
        print("held after step 3", flush=True)
        time.sleep(600)  # the test's SIGINT ends this

logger.MetricsLogger.log = held
from streamrl.cli import main
sys.exit(main())
"""


def _cli(policy_dir, out, *extra, entry=("-m", "streamrl.cli")) -> list[str]:
    return [sys.executable, *entry, "train", f"policy.path={policy_dir}", f"run.out_dir={out}",
            "mode=stream-async", "run.iterations=6", "generation.prompts_per_iter=4", "generation.n_samples=2",
            "generation.max_new_tokens=24", "task.num_eval=4", "run.eval_samples=1", "cluster.num_cpus=2",
            "logging.samples=true", "logging.backends=[console,jsonl]", *extra]


def test_sigint_checkpoints_and_the_resumed_run_trains_each_iteration_once(tiny_policy_dir, tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    wrapper = tmp_path / "held_cli.py"
    wrapper.write_text(HOLD_AFTER_STEP_3)
    err_file = tmp_path / "stderr.txt"  # a file, not a pipe: a full stderr pipe could stall the run
    with open(err_file, "w") as err_out:
        proc = subprocess.Popen(_cli(tiny_policy_dir, out, entry=(str(wrapper),)), cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err_out, text=True)
        try:
            for line in proc.stdout:  # interrupt while the run is held after iteration 2 (step 3)
                if line.startswith("held after step 3"):
                    proc.send_signal(signal.SIGINT)
                    break
            proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = err_file.read_text()
    assert proc.returncode == 130, err[-2000:]
    message = [line for line in err.splitlines() if line.startswith("streamrl: interrupted:")]
    assert len(message) == 1 and "saved in" in message[0], err[-2000:]
    saved = int(message[0].split("checkpoint of iteration ")[1].split()[0])
    assert saved >= 2 and (out / "checkpoint" / "trainer.pt").is_file()

    done = subprocess.run(_cli(tiny_policy_dir, out, "run.resume=true"), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {out / 'checkpoint'} at iteration {saved + 1}" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward/mean" in r]
    # what the data held and every fault counter are metrics, not only log lines
    assert rows[0]["step"] == 0 and rows[0]["data/oversized"] == 0.0 and "data/train_prompts" in rows[0]
    first = next(r for r in rows if "reward/mean" in r)
    assert all(k in first for k in ("sgs/faults", "sgs/requeued", "sgs/restarts", "sgs/resubmitted"))
    assert steps == [1, 2, 3, 4, 5, 6]  # every iteration logged once, in order, across the two runs
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    per_iter = {it: sum(r["iteration"] == it for r in samples) for it in range(6)}
    assert per_iter == {it: 4 * 2 for it in range(6)} and len(samples) == 48
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 6 and "eval/accuracy" in summary["after"]
    # the final weights' lineage (checkpointed, so it spans the two runs): every sample of the
    # schedule exactly once, the logged ones included
    lineage = json.loads((out / "lineage.json").read_text())
    assert len(lineage) == len(set(lineage)) == 48 and summary["trained_samples_unique"] == 48
    logged = {f"{r['iteration']}:{r['key']}/{r['sample_idx']}" for r in samples}
    assert set(lineage) == logged

"""Ctrl-C on `streamrl train` (a real SIGINT to the CLI process) in stream-async: the run says at
once that it will stop after the current step and stops there with a checkpoint; resumed and
given two Ctrl-C, it stops at once and keeps that checkpoint; resumed again, it trains each
remaining iteration once, so the logs hold every iteration exactly once.

The CLI runs under a wrapper that holds the run right after it logs a given iteration, until the
signal comes: each interrupt lands inside the loop, at a point the run cannot have passed."""

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


HOLD = """
import signal, sys, time
from streamrl.metrics import logger

# Ctrl-C as at a terminal: a shell that starts jobs in the background without job control gives
# them SIGINT ignored, and Python then keeps it ignored (the run would never see the interrupt).
signal.signal(signal.SIGINT, signal.default_int_handler)

log = logger.MetricsLogger.log

def held(self, step, metrics, echo=True):
    from streamrl.controller.interrupts import stop_requested

    log(self, step, metrics, echo)
    if step == STEP and "reward/mean" in metrics:
        print(f"held after step {step}", flush=True)
        deadline = time.time() + 600
        # UNTIL_STOP: the first Ctrl-C releases the run; else only a second one (KeyboardInterrupt) does
        while not (UNTIL_STOP and stop_requested()) and time.time() < deadline:
            time.sleep(0.05)

logger.MetricsLogger.log = held
from streamrl.cli import main
sys.exit(main())
"""


def _held_cli(tmp_path, policy_dir, out, step: int, until_stop: bool, *extra) -> list[str]:
    """The CLI under ``HOLD``: held after ``step`` until the interrupt."""
    wrapper = tmp_path / f"held_cli_{step}.py"
    wrapper.write_text(HOLD.replace("STEP", str(step)).replace("UNTIL_STOP", str(until_stop)))
    return _cli(policy_dir, out, *extra, entry=(str(wrapper),))


def _interrupt(cmd, env, err_path, step: int, times: int):
    """Run ``cmd``; when it is held after ``step``, send SIGINT, and a second one once the run has
    said it will stop (``times=2``). Returns (exit code, stdout after the hold, stderr)."""
    with open(err_path, "w") as err_out:  # a file, not a pipe: a full stderr pipe could stall the run
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err_out, text=True)
        try:
            for line in proc.stdout:
                if line.startswith(f"held after step {step}"):
                    proc.send_signal(signal.SIGINT)
                    break
            seen = []
            if times == 2:
                for line in proc.stdout:
                    seen.append(line)
                    if line.startswith("Ctrl-C: the run stops"):
                        proc.send_signal(signal.SIGINT)
                        break
            rest, _ = proc.communicate(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    return proc.returncode, "".join(seen) + rest, Path(err_path).read_text()



def _cli(policy_dir, out, *extra, entry=("-m", "streamrl.cli")) -> list[str]:
    return [sys.executable, *entry, "train", f"policy.path={policy_dir}", f"run.out_dir={out}",
            "mode=stream-async", "run.iterations=6", "generation.prompts_per_iter=4", "generation.n_samples=2",
            "generation.max_new_tokens=24", "task.num_eval=4", "run.eval_samples=1", "cluster.num_cpus=2",
            "logging.samples=true", "logging.backends=[console,jsonl]", *extra]


def test_sigint_checkpoints_and_the_resumed_run_trains_each_iteration_once(ray_session, tiny_policy_dir, tmp_path):
    out = tmp_path / "run"
    # the three runs join the session's Ray (cluster.address) instead of each starting and stopping one
    joined = (f"cluster.address={ray_session.get_runtime_context().gcs_address}", "cluster.ship_package=false")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "RAY_DEDUP_LOGS": "0"}
    code, rest, err = _interrupt(_held_cli(tmp_path, tiny_policy_dir, out, 3, True, *joined), env, tmp_path / "err1.txt", 3, 1)
    assert code == 130, err[-2000:]
    assert "Ctrl-C: the run stops after the current step and saves a checkpoint" in rest, rest[-2000:]
    message = [line for line in err.splitlines() if line.startswith("streamrl: interrupted:")]
    assert len(message) == 1 and "saved in" in message[0], err[-2000:]
    saved = int(message[0].split("checkpoint of iteration ")[1].split()[0])
    assert saved >= 2 and (out / "checkpoint" / "trainer.pt").is_file()

    # resumed, then two Ctrl-C: the run stops at once and the checkpoint of the first stop is kept
    before = (out / "checkpoint" / "trainer.pt").read_bytes()
    code, rest, err = _interrupt(_held_cli(tmp_path, tiny_policy_dir, out, saved + 2, False, "run.resume=true", *joined), env,
                                 tmp_path / "err2.txt", saved + 2, 2)
    assert code == 130, err[-2000:]
    message = [line for line in err.splitlines() if line.startswith("streamrl: interrupted:")]
    assert len(message) == 1 and "stopped at once; the last checkpoint written is kept" in message[0], err[-2000:]
    assert (out / "checkpoint" / "trainer.pt").read_bytes() == before

    done = subprocess.run(_cli(tiny_policy_dir, out, "run.resume=true", *joined), cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"resumed from {out / 'checkpoint'} at iteration {saved + 1}" in done.stdout
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in rows if "reward/mean" in r]
    # what the data held and every fault counter are metrics, not only log lines
    assert rows[0]["step"] == 0 and rows[0]["data/oversized"] == 0.0 and "data/train_prompts" in rows[0]
    first = next(r for r in rows if "reward/mean" in r)
    assert all(k in first for k in ("sgs/faults", "sgs/requeued", "sgs/restarts", "sgs/resubmitted"))
    assert steps == [1, 2, 3, 4, 5, 6]  # every iteration logged once, in order, across the three runs
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

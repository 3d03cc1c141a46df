"""One run per run directory: lock, refuse to mix runs, resume needs a checkpoint, logs cut back."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from streamrl.config import load_config
from streamrl.controller.rundir import RunDir, RunDirError


def _ckpt(out):
    (out / "checkpoint").mkdir(parents=True)
    (out / "checkpoint" / "trainer.pt").write_bytes(b"x")


def test_a_second_concurrent_run_is_locked_out_and_named(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from streamrl.controller.rundir import RunDir
        d = RunDir({str(tmp_path)!r}, resume=False, overwrite=False)
        print("locked", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunDirError, match=rf"in use by another run \(pid {holder.pid}\)"):
            RunDir(tmp_path, resume=False, overwrite=False)
    finally:
        holder.kill()
        holder.wait()
    RunDir(tmp_path, resume=False, overwrite=False).close()  # the lock died with its process


def test_a_fresh_run_into_a_used_directory_refuses_unless_overwrite(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    _ckpt(tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(RunDirError, match=r"already holds a run \(metrics.jsonl, checkpoint\).*run.overwrite=true"):
        RunDir(tmp_path, resume=False, overwrite=False)
    assert (tmp_path / "metrics.jsonl").is_file()  # nothing touched
    RunDir(tmp_path, resume=False, overwrite=True).close()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "checkpoint").exists()
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only a run's own files are removed


def test_resume_without_a_checkpoint_refuses(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(RunDirError, match="run.resume=true, but .* holds no checkpoint"):
        RunDir(tmp_path, resume=True, overwrite=False)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_resume_cuts_metrics_back_to_the_checkpoint(tmp_path):
    _ckpt(tmp_path)
    rows = [{"step": s, "v": s} for s in (0, 1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "v"')
    d = RunDir(tmp_path, resume=True, overwrite=False)
    try:
        assert d.cut_metrics(2) == 3  # steps 3 and 4, and the line the kill cut short
    finally:
        d.close()
    kept = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == rows[:3]


def test_train_refuses_a_used_run_directory_before_ray_starts(tmp_path):
    from streamrl.controller.driver import train

    (tmp_path / "summary.json").write_text("{}")
    cfg = load_config(None, [f"run.out_dir={tmp_path}", "policy.path=/nonexistent/tiny-policy"])
    with pytest.raises(RunDirError, match="already holds a run"):
        train(cfg)

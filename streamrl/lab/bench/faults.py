"""`streamrl bench faults`: a stream-async run under real faults against the same run without.

The run is the CLI (``python -m streamrl.cli train ...``) in a child process, so that it can be
killed like a machine that is lost. Two kinds of fault (``run_cli``), at seeded random times
within the fault-free run's duration: a generation instance killed (SIGKILL), and the driver
killed with everything under it, then resumed from its checkpoint.

Invariant: exactly-once is checked against ground truth computed here (``scheduled_ids``), never
reported by the run: the schedule of prompts against the final weights' lineage
(``exactly_once``). ``bench_soak`` tracks a long run's memory and open files over time.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from streamrl.config import Config

INSTANCE_TITLE = b"ray::GenerationInstance"


# ---------------------------------------------------------------------------------- processes
def _children() -> dict[int, list[int]]:
    """ppid -> child pids, from /proc."""
    kids: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        kids.setdefault(ppid, []).append(int(entry))
    return kids


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (not ``pid`` itself)."""
    kids, out, todo = _children(), [], [pid]
    while todo:
        for child in kids.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def instance_pids(driver_pid: int) -> list[int]:
    return [p for p in descendants(driver_pid) if _cmdline(p).startswith(INSTANCE_TITLE)]


def _kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and everything under it (collected first: orphans are re-parented)."""
    tree = [pid] + descendants(pid)
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return tree


def _wait_gone(pids: list[int], timeout_s: float = 60.0) -> None:
    deadline = time.time() + timeout_s
    while time.time() < deadline and any(Path(f"/proc/{p}").exists() and b"" != _cmdline(p) for p in pids):
        time.sleep(0.2)


# -------------------------------------------------------------------------------- one attempt
class Attempt:
    """One driver process: its output lines with wall times, read in a thread."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict) -> None:
        self.started = time.time()
        self.ended: float | None = None
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     start_new_session=True)
        self.lines: list[tuple[float, str]] = []
        self._log = open(log_path, "w")
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.time(), line.rstrip("\n")))
            self._log.write(line)
            self._log.flush()

    def first_iteration_after(self, t: float) -> float | None:
        return next((ts for ts, line in self.lines if ts >= t and line.startswith("iter")), None)

    def finish(self) -> int:
        rc = self.proc.wait()
        self.ended = self.ended or time.time()
        self._reader.join(timeout=30)
        self._log.close()
        return rc


def _schedule(rng: random.Random, kills: int, restarts: int, horizon_s: float) -> list[tuple[float, str]]:
    """Fault times (seconds from the start) within 15-85% of ``horizon_s``, kills and restarts mixed."""
    events = [(rng.uniform(0.15, 0.85) * horizon_s, "kill") for _ in range(kills)]
    events += [(rng.uniform(0.25, 0.75) * horizon_s, "restart") for _ in range(restarts)]
    return sorted(events)


def run_cli(cfg_args: list[str], out_dir: Path, env: dict, kills: int = 0, restarts: int = 0, horizon_s: float = 0.0,
            seed: int = 0, echo=print) -> dict[str, Any]:
    """The training run as child processes with faults injected; returns what happened.

    - **instance kill**: SIGKILL of one generation-instance process (a Ray worker whose process
      title is ``ray::GenerationInstance...``) among the run's descendants. The run must notice
      it, re-run the instance's requests elsewhere and start a replacement (``sgs/faults``; its
      record in ``out_dir/faults.jsonl`` gives the detection and replacement times).
    - **driver restart**: SIGKILL of the driver and every process under it (Ray included), then
      the same command with ``run.resume=true`` (or, before the first checkpoint, a fresh start
      with ``run.overwrite=true``)."""
    base = [sys.executable, "-m", "streamrl.cli", "train", *cfg_args, f"run.out_dir={out_dir}"]
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    events = _schedule(rng, kills, restarts, horizon_s)
    t0 = time.time()
    attempts = [Attempt(base + ["run.overwrite=true"], out_dir.parent / f"{out_dir.name}-attempt0.log", env)]
    records: list[dict[str, Any]] = []
    killed: set[int] = set()
    while True:
        cur = attempts[-1]
        wait = (t0 + events[0][0] - time.time()) if events else None
        try:
            cur.proc.wait(timeout=max(0.0, wait) if wait is not None else None)
            break  # the run ended (finished, or failed: the return code says)
        except subprocess.TimeoutExpired:
            pass
        _, kind = events.pop(0)
        if kind == "kill":
            def alive() -> list[int]:  # an instance killed a moment ago may not be reaped yet
                return [p for p in instance_pids(cur.proc.pid) if p not in killed]

            pids, deadline = alive(), time.time() + 60
            while not pids and time.time() < deadline and cur.proc.poll() is None:
                time.sleep(0.2)  # between a restart and its instances starting: wait for one
                pids = alive()
            if not pids:
                continue
            victim = rng.choice(pids)
            os.kill(victim, signal.SIGKILL)
            killed.add(victim)
            records.append({"kind": "kill", "t": time.time(), "pid": victim, "attempt": len(attempts) - 1})
            echo(f"  fault: killed generation instance pid {victim} at {time.time() - t0:.1f}s")
        else:
            t_kill = time.time()
            tree = _kill_tree(cur.proc.pid)
            cur.finish()
            _wait_gone(tree)
            resume = (out_dir / "checkpoint" / "trainer.pt").is_file()
            extra = ["run.resume=true"] if resume else ["run.overwrite=true"]
            attempts.append(Attempt(base + extra, out_dir.parent / f"{out_dir.name}-attempt{len(attempts)}.log", env))
            records.append({"kind": "restart", "t": t_kill, "resumed": resume, "attempt": len(attempts) - 1})
            echo(f"  fault: killed the driver and its {len(tree) - 1} processes at {t_kill - t0:.1f}s; "
                 f"{'resumed' if resume else 'restarted (no checkpoint yet)'}")
    rc = attempts[-1].finish()
    wall = time.time() - t0
    leftover = [p for a in attempts for p in descendants(a.proc.pid)]  # what an exited run left running
    _recovery(records, attempts, out_dir)
    return {"rc": rc, "wall_s": wall, "records": records, "attempts": len(attempts),
            "tail": [line for _, line in attempts[-1].lines[-15:]], "leftover_processes": len(leftover)}


def _recovery(records: list[dict], attempts: list[Attempt], out_dir: Path) -> None:
    """Seconds from each fault until the run was whole again: a kill, until its replacement
    instance held the current weights (the first ``faults.jsonl`` record after it from the same
    driver process: a driver killed before it logged the fault leaves none); a restart, until
    the resumed driver logged its first iteration."""
    latest: dict[tuple, dict] = {}  # a fault is written when it happens and again when replaced: keep the last
    if (out_dir / "faults.jsonl").is_file():
        for line in (out_dir / "faults.jsonl").read_text().splitlines():
            if line.strip():
                f = json.loads(line)
                latest[(f.get("fault"), f["time"])] = f
    faults = sorted(latest.values(), key=lambda f: f["time"])
    used: set[int] = set()
    for r in records:
        if r["kind"] == "kill":
            end = attempts[r["attempt"]].ended or float("inf")
            match = next((i for i, f in enumerate(faults) if i not in used and r["t"] - 1.0 <= f["time"] <= end), None)
            if match is not None:
                used.add(match)
                f = faults[match]
                r["detected_s"] = f["time"] - r["t"]
                r["recovery_s"] = (f["replaced_at"] - r["t"]) if f.get("replaced_at") else None
                r["requeued"] = f["requeued"]
        else:
            first = attempts[r["attempt"]].first_iteration_after(r["t"])
            r["recovery_s"] = (first - r["t"]) if first else None


# ------------------------------------------------------------------------------ ground truth
def scheduled_ids(cfg: Config) -> dict[tuple[int, str], int]:
    """(iteration, prompt id) -> samples the schedule asks for, computed as the driver does:
    the task's usable prompts in ``PromptStream`` order."""
    from streamrl.controller.common import PromptStream
    from streamrl.controller.setup import RunContext
    from streamrl.controller.prompts import usable_prompts
    from streamrl.models.tiny import load_tokenizer
    from streamrl.tasks.factory import make_task

    tok = load_tokenizer(cfg.policy.path)
    task = make_task(cfg)
    train, _, _ = usable_prompts(cfg, task, RunContext(cfg, task, tok).builder)
    stream = PromptStream(train, seed=cfg.run.seed, shuffle=not getattr(task, "ordered", False))
    out: dict[tuple[int, str], int] = Counter()
    for it in range(cfg.run.iterations):
        for p in stream.next_batch(cfg.generation.prompts_per_iter):
            out[(it, p.prompt_id)] += cfg.generation.n_samples
    return dict(out)


def exactly_once(schedule: dict[tuple[int, str], int], lineage: list[str]) -> dict[str, int]:
    """Lost and twice-trained prompts of the schedule in the final weights' lineage.

    The lineage (``out_dir/lineage.json``) is every request id the weights were trained on,
    checkpointed with them, so it spans restarts. A scheduled prompt with fewer samples than
    ``generation.n_samples`` in the lineage is lost; one with more, or any id not in the
    schedule, is trained twice."""
    got: Counter = Counter()
    unexpected = 0
    for rid in lineage:
        head, _, _ = rid.rpartition("/")
        it, _, pid = head.partition(":")
        key = (int(it), pid) if it.isdigit() else None
        if key in schedule:
            got[key] += 1
        else:
            unexpected += 1
    lost = sum(1 for k, n in schedule.items() if got[k] < n)
    twice = sum(1 for k, n in schedule.items() if got[k] > n) + unexpected
    return {"prompts_scheduled": len(schedule), "prompts_lost": lost, "prompts_trained_twice": twice,
            "samples_trained": len(lineage), "samples_scheduled": sum(schedule.values())}


# ---------------------------------------------------------------------------------- the bench
def bench_faults(cfg: Config, cfg_args: list[str], out_root: Path, kills: int, restarts: int, seed: int,
                 echo=print) -> dict[str, Any]:
    """The fault-free run, then the run with ``kills`` instance kills and ``restarts`` driver
    restarts at seeded random times within the fault-free run's duration."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parents[3])] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))}
    schedule = scheduled_ids(cfg)
    rows = []
    echo("fault-free run ...")
    clean = run_cli(cfg_args, out_root / "no-faults", env, echo=echo)
    echo(f"faulty run ({kills} instance kills, {restarts} driver restarts) ...")
    faulty = run_cli(cfg_args, out_root / "faults", env, kills=kills, restarts=restarts, horizon_s=clean["wall_s"],
                     seed=seed, echo=echo)
    for name, res in (("no faults", clean), ("faults", faulty)):
        d = out_root / ("no-faults" if res is clean else "faults")
        if res["rc"] != 0:
            raise RuntimeError(f"the {name} run failed (exit {res['rc']}): " + " | ".join(res["tail"]))
        lineage = json.loads((d / "lineage.json").read_text())
        summary = json.loads((d / "summary.json").read_text())
        check = exactly_once(schedule, lineage)
        rows.append({"run": name, "kills": sum(r["kind"] == "kill" for r in res["records"]),
                     "restarts": sum(r["kind"] == "restart" for r in res["records"]), **check,
                     "wall_s": res["wall_s"], "samples_per_s": check["samples_trained"] / res["wall_s"],
                     "eval_accuracy_after": summary["after"]["eval/accuracy"],
                     "leftover_processes": res["leftover_processes"]})
    ok, bad = rows[0], rows[1]
    faults = [{k: v for k, v in r.items() if k != "t"} for r in faulty["records"]]
    return {
        "kills": bad["kills"], "restarts": bad["restarts"], "prompts_lost": bad["prompts_lost"],
        "prompts_trained_twice": bad["prompts_trained_twice"], "samples_per_s": bad["samples_per_s"],
        "samples_per_s_no_faults": ok["samples_per_s"], "samples_per_s_ratio": bad["samples_per_s"] / ok["samples_per_s"],
        "eval_accuracy_after": bad["eval_accuracy_after"], "eval_accuracy_after_no_faults": ok["eval_accuracy_after"],
        "recovery_s": [f.get("recovery_s") for f in faults], "faults": faults, "rows": rows, "seed": seed,
        "args": cfg_args,
    }


# ------------------------------------------------------------------------------------- soak
def _role(pid: int) -> str:
    """A process's role by its title: ray::<Actor>, raylet, gcs_server, the driver, ..."""
    raw = _cmdline(pid).split(b"\0")
    head = raw[0].decode(errors="replace")
    if head.startswith("ray::"):
        return head.split(".")[0].split()[0]
    name = Path(head).name
    if "python" in name and len(raw) > 1:
        mod = next((a.decode(errors="replace") for a in raw[1:] if a and not a.startswith(b"-")), "")
        return f"python {Path(mod).name}" if mod else name
    return name or "?"


def _sample(pid: int) -> list[dict[str, Any]]:
    """RSS (MB) and open files of ``pid`` and every process under it."""
    import math

    from streamrl.controller.stats import rss_mb

    rows = []
    for p in [pid] + descendants(pid):
        try:
            rss, fds = rss_mb(p), len(os.listdir(f"/proc/{p}/fd"))
        except OSError:
            continue
        if not math.isnan(rss):  # gone meanwhile, or a zombie
            rows.append({"pid": p, "role": "driver" if p == pid else _role(p), "rss_mb": rss, "open_files": fds})
    return rows


def _shm() -> dict[str, Any]:
    try:
        files = [f for f in Path("/dev/shm").iterdir() if f.is_file()]
    except OSError:
        return {"files": None, "bytes": None, "names": []}
    return {"files": len(files), "bytes": sum(f.stat().st_size for f in files), "names": sorted(f.name for f in files)}


def slope_per_100(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ``ys`` over ``xs``, per 100 units of ``xs`` (0 with < 3 points)."""
    import numpy as np

    if len(xs) < 3:
        return 0.0
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0] * 100)


def role_table(samples: list[dict[str, Any]], iterations: int) -> list[dict[str, Any]]:
    """Per role (several processes may share one): RSS and open files at the first sample and the
    last one of the loop, their slopes per 100 iterations over the loop's second half, the mean and
    the lowest RSS of each block of 100 iterations, the slope of those floors after the first block
    (a sample may land at a step's peak or between steps: the mean moves by the size of a step's
    tensors, the floor only by what stays), and the peak after the loop (samples whose
    ``iteration`` is ``iterations``: the end-of-run report)."""
    half = iterations // 2
    by_role: dict[str, list[dict]] = {}
    for s in samples:
        by_role.setdefault(s["role"], []).append(s)
    table = []
    for role, ss in sorted(by_role.items()):
        # per sample time, the role's total (several processes may share a role)
        at: dict[float, dict[str, float]] = {}
        for s in ss:
            cur = at.setdefault(s["t"], {"iteration": s["iteration"], "rss_mb": 0.0, "open_files": 0.0, "n": 0})
            cur["rss_mb"] += s["rss_mb"]
            cur["open_files"] += s["open_files"]
            cur["n"] += 1
        ordered = [v for _, v in sorted(at.items())]
        loop = [v for v in ordered if v["iteration"] < iterations] or ordered
        pts = [v for v in loop if v["iteration"] >= half]
        after = [v["rss_mb"] for v in ordered if v["iteration"] >= iterations]
        first, last = ordered[0], loop[-1]
        blocks: dict[int, list[float]] = {}
        for v in loop:
            blocks.setdefault(v["iteration"] // 100, []).append(v["rss_mb"])
        table.append({"role": role, "processes": last["n"], "rss_mb_first": first["rss_mb"],
                      "rss_mb_last": last["rss_mb"], "rss_mb_after_loop": max(after, default=float("nan")),
                      "rss_mb_per_block": {100 * b: sum(v) / len(v) for b, v in sorted(blocks.items())},
                      "rss_mb_floor_per_block": {100 * b: min(v) for b, v in sorted(blocks.items())},
                      "rss_mb_floor_per_100_iter": slope_per_100(
                          [100 * b for b in sorted(blocks) if b >= 1], [min(blocks[b]) for b in sorted(blocks) if b >= 1]),
                      "rss_mb_per_100_iter": slope_per_100(
                          [p["iteration"] for p in pts], [p["rss_mb"] for p in pts]),
                      "open_files_last": last["open_files"], "open_files_per_100_iter": slope_per_100(
                          [p["iteration"] for p in pts], [p["open_files"] for p in pts])})
    return table


def bench_soak(cfg_args: list[str], out_dir: Path, sample_s: float = 5.0, echo=print) -> dict[str, Any]:
    """One long run as a child process: every ``sample_s`` seconds the resident memory and open
    files of each of its processes; Ray's object store per iteration (the driver logs it); files
    in /dev/shm before and after. Slopes are fitted over the second half of the iterations, after
    the warm-up (allocator pools, caches) has settled, and before the end-of-run report (the final
    evaluation, timeline picture and policy export, whose peak is ``rss_mb_after_loop``)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    shm_before = _shm()
    out_dir.mkdir(parents=True, exist_ok=True)
    att = Attempt([sys.executable, "-m", "streamrl.cli", "train", *cfg_args, f"run.out_dir={out_dir}",
                   "run.overwrite=true"], out_dir.parent / f"{out_dir.name}.log", env)
    samples: list[dict[str, Any]] = []
    while att.proc.poll() is None:
        t = time.time() - att.started
        it = sum(1 for _, line in att.lines if line.startswith("iter"))
        for row in _sample(att.proc.pid):
            samples.append({"t": t, "iteration": it, **row})
        try:
            att.proc.wait(timeout=sample_s)
        except subprocess.TimeoutExpired:
            pass
    rc = att.finish()
    time.sleep(2.0)
    shm_after = _shm()
    if rc != 0:
        raise RuntimeError(f"the soak run failed (exit {rc}): " + " | ".join(line for _, line in att.lines[-15:]))
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    per_iter = [r for r in rows if "sys/driver_rss_mb" in r]
    iterations = len(per_iter)
    half = iterations // 2
    table = role_table(samples, iterations)
    second = per_iter[half:]
    store = [r.get("sys/object_store_bytes") for r in second if r.get("sys/object_store_bytes") is not None]
    steps = [r["step"] for r in second if r.get("sys/object_store_bytes") is not None]
    return {
        "iterations": iterations, "wall_s": time.time() - att.started, "samples": len(samples),
        "processes": table,
        "object_store_mb_first": per_iter[0].get("sys/object_store_bytes", float("nan")) / 2**20 if per_iter else None,
        "object_store_mb_last": per_iter[-1].get("sys/object_store_bytes", float("nan")) / 2**20 if per_iter else None,
        "object_store_mb_per_100_iter": slope_per_100(steps, [b / 2**20 for b in store]),
        "object_store_objects_last": per_iter[-1].get("sys/object_store_objects") if per_iter else None,
        "shm_files_before": shm_before["files"], "shm_files_after": shm_after["files"],
        "shm_new_files": sorted(set(shm_after["names"]) - set(shm_before["names"])),
        "leftover_processes": len(descendants(att.proc.pid)),
        "series": samples,
    }

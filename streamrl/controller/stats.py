"""What a run reports about itself: per-iteration sample metrics, the processes' memory, the
reward trend and how well the stages overlapped."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from streamrl.controller.common import length_stats

def system_metrics() -> dict[str, float]:
    """The driver's resident memory and open files, and the Ray object store's bytes and objects
    (read from the raylet; absent where Ray does not answer): what ``bench soak`` watches for leaks."""
    import resource

    out = {"sys/driver_rss_mb": rss_mb(os.getpid()), "sys/driver_open_files": float(len(os.listdir("/proc/self/fd")))
           if os.path.isdir("/proc/self/fd") else float("nan")}
    out["sys/driver_maxrss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    try:
        from ray._private.internal_api import get_memory_info_reply, get_state_from_address

        stats = get_memory_info_reply(get_state_from_address(None), timeout_seconds=5).store_stats
        out["sys/object_store_bytes"] = float(stats.object_store_bytes_used)
        out["sys/object_store_objects"] = float(stats.num_local_objects)
    except Exception:  # noqa: BLE001 - a private Ray API: the run never depends on it
        pass
    return out


def rss_mb(pid: int) -> float:
    """Resident memory of process ``pid`` in MB (/proc), NaN if it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def reward_trend(rewards: list[float]) -> dict[str, float]:
    """How the per-iteration training reward moved: means of the first and last thirds of the
    iterations and the least-squares slope per iteration (one batch of prompts is noisy; these
    are not)."""
    if len(rewards) < 3:
        return {}
    r = np.asarray(rewards, dtype=float)
    third = len(r) // 3
    slope = float(np.polyfit(np.arange(len(r)), r, 1)[0])
    return {"first_third_mean": float(r[:third].mean()), "last_third_mean": float(r[-third:].mean()),
            "slope_per_iter": slope}


def pipeline_stats(logger, timeline, rl_seconds: float, iterations: int) -> dict[str, float]:
    """How well the run overlapped its stages: ``efficiency`` = max(mean generation time, mean
    training time per iteration) / the measured step time (1.0 = the slower stage alone sets the
    pace, as with perfect overlap; colocated runs sit near gen / (gen + train)), and the busy
    fractions of the generation instances and the trainer over the run (from the timeline);
    ``logger`` gives the running means (``MetricsLogger.mean``)."""
    step_s = rl_seconds / max(iterations, 1)
    gen_s = logger.mean("time/gen_s")
    train_s = logger.mean("time/train_s") + (logger.mean("time/prepare_s") if logger.has("time/prepare_s") else 0.0)
    summary = timeline.summary()
    gen_rows = [r for r in timeline.rows() if r != "trainer"]
    busy = [summary.get(f"busy/{r}", 0.0) for r in gen_rows]
    return {"step_s": step_s, "gen_s": gen_s, "train_s": train_s,
            "efficiency": max(gen_s, train_s) / step_s if step_s > 0 else float("nan"),
            "gen_busy": float(np.mean(busy)) if busy else float("nan"), "train_busy": summary.get("busy/trainer", float("nan"))}


def sample_metrics(samples) -> dict[str, float]:
    lengths = [s.num_response_tokens for s in samples]
    rewards = [s.reward for s in samples]
    m = {"reward/mean": float(np.mean(rewards)) if rewards else 0.0, "batch/samples": len(samples),
         "reward/accuracy": float(np.mean([r >= 1.0 for r in rewards])) if rewards else 0.0,
         "reward/errors_in_iter": sum(1 for s in samples if s.reward_info.get("error"))}
    components: dict[str, list[float]] = {}
    for smp in samples:
        for name, value in smp.reward_info.get("components", {}).items():
            components.setdefault(name, []).append(value)
    m.update({f"reward/component/{k}": float(np.mean(v)) for k, v in components.items()})
    m.update(length_stats(lengths))
    m["resp_len/truncated_frac"] = float(np.mean([s.completion.finish_reason == "length" for s in samples])) if samples else 0.0
    return m

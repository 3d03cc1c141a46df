"""Reward curves of finished runs, side by side: the convergence check of the pipeline modes.

The paper's claim for one-step asynchrony is that it converges like synchronous training. Here
that is a comparison of runs that differ only in ``mode`` (and seed): each run directory holds
its ``config.yaml`` and ``metrics.jsonl`` (written by ``streamrl train``). Per-iteration reward
of one batch is noisy, so the comparison uses the mean of the last third of the iterations and
sets the difference between modes against the spread between seeds of the same mode.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import yaml


def mode_label(cfg: dict) -> str:
    """The mode as ``bench modes`` names its rows: ``stream-async-k4-partial`` for a run beyond
    one-step asynchrony, with ``+decoupled`` / ``+tis`` for an off-policy correction."""
    mode = cfg.get("mode", "?")
    k = (cfg.get("trainer") or {}).get("max_staleness")
    partial = (cfg.get("generation") or {}).get("partial_rollout")
    correction = (cfg.get("trainer") or {}).get("correction", "none")
    if k not in (None, 1) and mode == "stream-async":
        mode += f"-k{k}"
    if partial:
        mode += "-partial"
    return mode + (f"+{correction}" if correction not in (None, "none") else "")


def load_run(run_dir: str | Path) -> dict:
    """``{"run", "mode", "seed", "rewards": [...], "eval_before", "eval_after"}`` of a finished run."""
    run_dir = Path(run_dir)
    cfg_path, metrics_path = run_dir / "config.yaml", run_dir / "metrics.jsonl"
    for p in (cfg_path, metrics_path):
        if not p.is_file():
            raise FileNotFoundError(f"{run_dir} is not a finished streamrl run: {p.name} is missing")
    cfg = yaml.safe_load(cfg_path.read_text())
    rewards: dict[int, float] = {}
    evals: list[tuple[int, float]] = []
    for line_no, line in enumerate(metrics_path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{metrics_path}:{line_no}: not JSON ({exc})") from None
        if "reward/mean" in rec:
            rewards[int(rec["step"])] = float(rec["reward/mean"])  # a resumed run rewrites a step: keep the last
        if "eval/accuracy" in rec:
            evals.append((int(rec["step"]), float(rec["eval/accuracy"])))
    if not rewards:
        raise ValueError(f"{metrics_path} holds no per-iteration reward (reward/mean)")
    steps = sorted(rewards)
    evals.sort()
    return {"run": run_dir.name, "mode": mode_label(cfg), "seed": cfg.get("run", {}).get("seed"),
            "rewards": [rewards[s] for s in steps],
            "eval_before": evals[0][1] if evals and evals[0][0] == 0 else float("nan"),
            "eval_after": evals[-1][1] if evals and evals[-1][0] > 0 else float("nan")}


def last_third_mean(rewards: list[float]) -> float:
    r = np.asarray(rewards, dtype=float)
    return float(r[-max(1, len(r) // 3):].mean())


def compare(runs: list[dict]) -> dict:
    """Per-run rows, per-mode rows, and the verdict: does every pair of modes differ by less than
    the larger within-mode seed spread (range of the last-third means)? With one seed per mode
    there is no noise estimate and the verdict is None."""
    rows = [{"run": r["run"], "mode": r["mode"], "seed": r["seed"], "iterations": len(r["rewards"]),
             "reward_first_third": float(np.mean(r["rewards"][: max(1, len(r["rewards"]) // 3)])),
             "reward_last_third": last_third_mean(r["rewards"]),
             "eval_before": r["eval_before"], "eval_after": r["eval_after"]} for r in runs]
    by_mode: dict[str, list[dict]] = {}
    for row in rows:
        by_mode.setdefault(row["mode"], []).append(row)
    mode_rows = []
    for mode, rs in by_mode.items():
        last = [r["reward_last_third"] for r in rs]
        after = [r["eval_after"] for r in rs]
        mode_rows.append({"mode": mode, "runs": len(rs), "reward_last_third_mean": float(np.mean(last)),
                          "seed_spread": float(np.ptp(last)) if len(last) > 1 else float("nan"),
                          "eval_after_mean": float(np.nanmean(after)) if not all(np.isnan(after)) else float("nan")})
    spreads = [m["seed_spread"] for m in mode_rows if not np.isnan(m["seed_spread"])]
    means = [m["reward_last_third_mean"] for m in mode_rows]
    gap = float(max(means) - min(means)) if len(means) > 1 else 0.0
    noise = max(spreads) if spreads else None
    verdict = None if noise is None or len(means) < 2 else bool(gap <= noise)
    return {"runs": rows, "modes": mode_rows, "gap_between_modes": gap, "seed_noise": noise,
            "modes_agree_within_seed_noise": verdict}


def plot(runs: list[dict], path: str | Path, smooth: int = 5, title: str = "training reward per iteration") -> None:
    """One line per run (moving average over ``smooth`` iterations), coloured by mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({r["mode"] for r in runs})
    colours = dict(zip(modes, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    seen: set[str] = set()
    for r in runs:
        y = np.asarray(r["rewards"], dtype=float)
        k = max(1, min(smooth, len(y)))
        ys = np.convolve(y, np.ones(k) / k, mode="valid")
        x = np.arange(k, len(y) + 1)
        label = r["mode"] if r["mode"] not in seen else None
        seen.add(r["mode"])
        ax.plot(x, ys, color=colours[r["mode"]], label=label, alpha=0.85)
        ax.plot(np.arange(1, len(y) + 1), y, color=colours[r["mode"]], alpha=0.15, linewidth=0.8)
    ax.set_xlabel("iteration")
    ax.set_ylabel(f"reward (moving average of {smooth})")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)

"""The resource planner: Algorithm 1 over an estimator (simulated or measured).

``plan_single_dc`` splits ``n`` devices of one type between generation and training;
``plan_cross_dc`` keeps generation in one site and training in another and shrinks the faster side.
Both return a plain dict: the split, the parallel configuration, and the predicted stage times.
The trainer's configuration is ZeRO-3 data parallel over its devices (the only one our cost model
has); the generation side reports its tensor-parallel degree and instance count.
"""

from __future__ import annotations

from typing import Any

from streamrl.scheduling.balance import (Balance, balance_cross_dc, balance_single_dc, flatness,
                                       sweep_cross_dc, sweep_single_dc)


def _sweep_rows(cands: list[Balance], chosen: Balance, est: Any = None) -> list[dict[str, Any]]:
    if not any((c.gen_devices, c.train_devices) == (chosen.gen_devices, chosen.train_devices) for c in cands):
        cands = sorted(cands + [chosen],
                       key=lambda c: (c.gen_devices, c.train_devices))  # a tie Algorithm 1 broke off the frontier
    return [{"gen_gpus": c.gen_devices, **({"gen_tp": est.gen_config(c.gen_devices)["tp"]} if est is not None else {}),
             "train_gpus": c.train_devices, "t_gen_s": c.t_gen, "t_train_s": c.t_train, "t_iter_s": c.t_iter,
             "chosen": (c.gen_devices, c.train_devices) == (chosen.gen_devices, chosen.train_devices)}
            for c in cands]


def sweep_single(est: Any, n: int, chosen: Balance, train_unit: int = 1) -> dict[str, Any]:
    """The reasoning behind ``plan_single_dc``: predicted stage times over every split on the
    frontier (``x`` generation devices, the rest training), and how flat the optimum is."""
    cands = sweep_single_dc(n, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    return {"candidates": _sweep_rows(cands, chosen, est), "flatness": flatness(cands)}


def sweep_cross(est: Any, gen_gpus: int, train_gpus: int, chosen: Balance, train_unit: int = 1) -> dict[str, Any]:
    """The reasoning behind ``plan_cross_dc``: the faster side's sizes and their stage times."""
    cands = sweep_cross_dc(gen_gpus, train_gpus, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    return {"candidates": _sweep_rows(cands, chosen, est), "flatness": flatness(cands)}


def _row(b: Balance, est: Any, **extra: Any) -> dict[str, Any]:
    cfg = est.gen_config(b.gen_devices)
    return {
        **extra,
        "gen_gpus": b.gen_devices, "gen_tp": cfg["tp"], "gen_instances": cfg["instances"],
        "train_gpus": b.train_devices, "train_parallel": f"zero3-dp{b.train_devices}",
        "t_gen_s": b.t_gen, "t_train_s": b.t_train, "t_iter_s": b.t_iter,
        "bottleneck": "generation" if b.t_gen >= b.t_train else "training",
    }


def plan_single_dc(est: Any, n: int, train_unit: int = 1, sweep: bool = False, **extra: Any):
    """The split (a row); with ``sweep``, ``(row, sweep_single(...))``."""
    b = balance_single_dc(n, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    row = _row(b, est, total_gpus=n, **extra)
    return (row, sweep_single(est, n, b, train_unit)) if sweep else row


def plan_cross_dc(est: Any, gen_gpus: int, train_gpus: int, train_unit: int = 1, sweep: bool = False, **extra: Any):
    """The split (a row); with ``sweep``, ``(row, sweep_cross(...))``."""
    b = balance_cross_dc(gen_gpus, train_gpus, est.p_gen, est.p_train, gen_unit=est.gen_unit, train_unit=train_unit)
    row = _row(b, est, gen_gpus_available=gen_gpus, train_gpus_available=train_gpus, **extra)
    return (row, sweep_cross(est, gen_gpus, train_gpus, b, train_unit)) if sweep else row


def plot_sweep(sweep: dict[str, Any], path: str, title: str = "", cross_dc: bool = False) -> str:
    """Predicted stage times over the candidate splits (``sweep_single``/``sweep_cross``), the
    chosen one marked and the near-optimal band shaded; written as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cands = sweep["candidates"]
    side = "train_gpus" if cross_dc and len({c["gen_gpus"] for c in cands}) == 1 else "gen_gpus"
    xs = [c[side] for c in cands]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [c["t_gen_s"] for c in cands], label="generation", marker=".")
    ax.plot(xs, [c["t_train_s"] for c in cands], label="training", marker=".")
    ax.plot(xs, [c["t_iter_s"] for c in cands], label="iteration (slower stage)", color="black", lw=2)
    flat = sweep.get("flatness") or {}
    if flat:
        key = "near_train" if side == "train_gpus" else "near_gen"
        ax.axvspan(flat[f"{key}_min"], flat[f"{key}_max"], color="green", alpha=0.12,
                   label=f"within {flat['tolerance']:.0%} of the best")
    for c in cands:
        if c["chosen"]:
            ax.axvline(c[side], color="red", ls="--", label=f"chosen: {c['gen_gpus']} gen + {c['train_gpus']} train")
    ax.set_xlabel("training devices" if side == "train_gpus" else "generation devices (the rest train)")
    ax.set_ylabel("predicted seconds per iteration")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path

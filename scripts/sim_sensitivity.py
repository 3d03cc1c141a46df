"""How the simulator's results move when one cost-model input moves within its plausible range
(the sensitivity table of docs/simulator.md).

    python scripts/sim_sensitivity.py [--out FILE.json] [--jobs 2] [--only NAME ...] [--set NAME=VALUE ...]

For each input and each end of its range, one at a time: the 18 ratios of `simulate e2e`
(stream-sync / colocated and stream-async / colocated in 9 configurations), their mean and
largest change against the baseline, how many configurations break the ordering stream-async >
stream-sync > colocated, the planner's splits (generation GPUs) for 32B/64 and 72B/128 at 20K,
the three steps of `simulate ablation` (72B/128, 20K, normalised to colocated) and the
cross-datacenter gain in throughput per cost of `simulate hetero` at 5K/10K/20K (as deployed,
and in Algorithm 1's shrunk form). Inputs that
only touch the heterogeneous deployment (H20 price, the cross-site link) rerun only `hetero`.
Module globals are patched in the worker process for one run; nothing here is fitted. ``--set``
changes the baseline itself (to explore an alternative model).
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ProcessPoolExecutor
from dataclasses import replace

from streamrl.lab.sim import cost, hardware, systems
from streamrl.lab.sim import experiments as E

# name -> (low, high): the range we consider plausible (docs/simulator.md says why)
RANGES = {
    "ETA_MEM": (0.7, 0.9),
    "T0": (1.5e-3, 4.0e-3),
    "ETA_DECODE": (0.4, 0.8),
    "ETA_PREFILL": (0.4, 0.8),
    "ALLREDUCE_LATENCY": (5e-6, 30e-6),
    "KV_MEM_FRACTION": (0.7, 0.95),
    "MFU_BASE": (0.35, 0.55),
    "KAPPA": (0.0, 0.55),
    "TRAIN_MEM_FRACTION": (0.6, 0.8),
    "CPU_OFFLOAD_BYTES_PER_S": (5e9, 50e9),
    "MIN_TOKENS_PER_GPU": (4096, 16384),
    "H800_COST_PER_NODE": (2.3, 3.4),
    "CROSS_DC_GBPS": (40, 100),
}
HETERO_ONLY = {"H800_COST_PER_NODE", "CROSS_DC_GBPS"}
SYSTEMS = ("colocated", "stream-sync", "stream-async")


def apply(name: str, value: float) -> None:
    """Set one input in this process."""
    if hasattr(cost, name):
        setattr(cost, name, value)
    elif name == "MIN_TOKENS_PER_GPU":
        systems.MIN_TOKENS_PER_GPU = value
    elif name == "H800_COST_PER_NODE":
        hardware.GPUS["H800"] = replace(hardware.GPUS["H800"], cost_per_node=value)
    elif name == "CROSS_DC_GBPS":
        E.CROSS_DC_LINK = hardware.Link(value * hardware.GBPS, hardware.CROSS_DC_LINK.latency_s, f"cross-dc {value} Gbps")
    else:
        raise SystemExit(f"sim_sensitivity: unknown input {name!r}")


def run(settings: dict[str, float] | None = None, parts: tuple[str, ...] = ("e2e", "ablation", "hetero")) -> dict:
    for name, value in (settings or {}).items():
        apply(name, value)
    out: dict = {}
    if "e2e" in parts:
        rows = E.e2e(E.E2E_SETUPS, E.MAX_LENS, SYSTEMS, iterations=4, seed=0)
        by = {(r["model"], r["max_len"], r["system"]): r for r in rows}
        ratios, broken, splits = {}, 0, {}
        for model, _gpus in E.E2E_SETUPS:
            for max_len in E.MAX_LENS:
                col = by[(model, max_len, "colocated")]["samples_per_s"]
                sync = by[(model, max_len, "stream-sync")]["samples_per_s"]
                asy = by[(model, max_len, "stream-async")]["samples_per_s"]
                ratios[f"{model}@{max_len}/sync"] = sync / col
                ratios[f"{model}@{max_len}/async"] = asy / col
                broken += not (asy > sync > col)
                if max_len == 20000:
                    splits[model] = by[(model, max_len, "stream-async")]["gen_gpus"]
        out.update(ratios=ratios, ordering_broken=broken, gen_gpus_at_20k=splits)
    if "ablation" in parts:
        out["ablation"] = [r["normalized"] for r in E.ablation()][1:]
    if "hetero" in parts:
        rows = E.hetero()
        # as deployed (32 H20 + 16 H800, all charged), and Algorithm 1's shrunk form (freed devices not charged)
        out["hetero_gain"] = {str(r["max_len"]): r["gain"] for r in rows if r["setup"] == "cross-dc-all"}
        out["hetero_gain_shrunk"] = {str(r["max_len"]): r["gain"] for r in rows if r["setup"] == "cross-dc"}
    return out


def _variant(args: tuple[str, float, dict[str, float]]) -> tuple[str, float, dict]:
    name, value, base_settings = args
    parts = ("hetero",) if name in HETERO_ONLY else ("e2e", "ablation", "hetero")
    return name, value, run({**base_settings, name: value}, parts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--only", nargs="*", default=None, help="inputs to vary (default: all)")
    ap.add_argument("--set", nargs="*", default=[], metavar="NAME=VALUE", help="change the baseline")
    args = ap.parse_args()
    base_settings = {k: float(v) for k, v in (s.split("=", 1) for s in args.set)}
    names = args.only if args.only is not None else list(RANGES)
    unknown = [n for n in names if n not in RANGES]
    if unknown:
        raise SystemExit(f"sim_sensitivity: unknown input(s) {unknown}; known: {sorted(RANGES)}")
    jobs = [(n, v, base_settings) for n in names for v in RANGES[n]]
    # one task per worker process: each patches module globals and must start from the defaults
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), max_tasks_per_child=1) as pool:
        base_f = pool.submit(run, base_settings)
        futures = [pool.submit(_variant, j) for j in jobs]
        base = base_f.result()
        print(json.dumps({"baseline": base}), flush=True)
        table = [{"input": "baseline", "value": "", **_summary(base, base)}]
        for f in futures:
            name, value, res = f.result()
            merged = {**base, **res}
            table.append({"input": name, "value": value, **_summary(merged, base), "raw": res})
            print(json.dumps({k: v for k, v in table[-1].items() if k != "raw"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"baseline_settings": base_settings, "baseline": base, "rows": table}, f, indent=1)


def _summary(res: dict, base: dict) -> dict:
    d = [abs(res["ratios"][k] - base["ratios"][k]) for k in base["ratios"]]
    return {"mean_abs_ratio_change": sum(d) / len(d), "max_abs_ratio_change": max(d),
            "ordering_broken": res["ordering_broken"],
            **{f"gen_gpus_{m}": g for m, g in res["gen_gpus_at_20k"].items()},
            "ablation": [round(x, 3) for x in res["ablation"]],
            "hetero_gain": [round(res["hetero_gain"][str(n)], 3) for n in E.MAX_LENS],
            "hetero_gain_shrunk": [round(res["hetero_gain_shrunk"][str(n)], 3) for n in E.MAX_LENS]}


if __name__ == "__main__":
    main()

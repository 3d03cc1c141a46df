"""How the simulator's e2e results move when one cost-model constant moves within its plausible
range (the sensitivity column of docs/simulator.md).

    python scripts/sim_sensitivity.py [--out FILE.json]

For each constant and each end of its range: the 18 ratios of `simulate e2e` (stream-sync /
colocated and stream-async / colocated in 9 configurations), their mean and largest change
against the baseline, how many configurations break the ordering stream-async > stream-sync >
colocated, and the planner's splits (gen GPUs) for 32B/64 and 72B/128 at 20K. Module constants
are patched in place for one run and restored; nothing here is fitted.
"""

from __future__ import annotations

import argparse
import json

from streamrl.sim import cost
from streamrl.sim import experiments as E

# constant -> (module, low, high): the range we consider plausible (see docs/simulator.md)
RANGES = {
    "ETA_MEM": (cost, 0.7, 0.9),
    "T0": (cost, 1.5e-3, 4.0e-3),
    "ETA_DECODE": (cost, 0.4, 0.8),
    "MFU_BASE": (cost, 0.35, 0.55),
    "KAPPA": (cost, 0.3, 0.8),
    "TRAIN_MEM_FRACTION": (cost, 0.6, 0.8),
    "CPU_OFFLOAD_BYTES_PER_S": (cost, 12e9, 50e9),
    "ETA_PREFILL": (cost, 0.4, 0.8),
    "ALLREDUCE_LATENCY": (cost, 5e-6, 30e-6),
    "KV_MEM_FRACTION": (cost, 0.7, 0.95),
}
SYSTEMS = ("colocated", "stream-sync", "stream-async")


def run() -> dict:
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
    return {"ratios": ratios, "ordering_broken": broken, "gen_gpus_at_20k": splits}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = run()
    table = [{"constant": "baseline", "value": "", **_summary(base, base)}]
    for name, (module, low, high) in RANGES.items():
        saved = getattr(module, name)
        for value in (low, high):
            setattr(module, name, value)
            try:
                res = run()
            finally:
                setattr(module, name, saved)
            table.append({"constant": name, "value": value, **_summary(res, base), "raw": res})
            print(json.dumps({k: v for k, v in table[-1].items() if k != "raw"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"baseline": base, "rows": table}, f, indent=1)


def _summary(res: dict, base: dict) -> dict:
    d = [abs(res["ratios"][k] - base["ratios"][k]) for k in base["ratios"]]
    return {"mean_abs_ratio_change": sum(d) / len(d), "max_abs_ratio_change": max(d),
            "ordering_broken": res["ordering_broken"], **{f"gen_gpus_{m}": g for m, g in res["gen_gpus_at_20k"].items()}}


if __name__ == "__main__":
    main()

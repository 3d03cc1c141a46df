"""The tensor-parallel audit of the simulator (docs/simulator.md, "Tensor parallelism"): how
the e2e ratios, the ordering, the planner's splits, the ablation steps, the heterogeneous gain
and PAPER.md §1's device scaling of generation move with the generation instances' TP degree.

    python scripts/sim_tp_audit.py [--out FILE.json]

Policies: ``search`` (the fastest degree that fits, per device count), ``min-fit`` (the
default: the smallest degree that fits; 1 / 2 / 4 for 7B / 32B / 72B on H800) and fixed degrees
per model (7B / 32B / 72B), as a deployment configures them. Nothing here is fitted.
"""

from __future__ import annotations

import argparse
import json

from sim_sensitivity import run as e2e_summary

from streamrl.lab.planner.plan import plan_single_dc
from streamrl.lab.sim import estimators
from streamrl.lab.sim import experiments as E
from streamrl.lab.sim.estimators import SimEstimator
from streamrl.lab.sim.hardware import get_gpu
from streamrl.lab.sim.models import get_model
from streamrl.lab.sim.workload import r1_workload

POLICIES = {"search": "search", "min-fit (1/2/4)": "min-fit", "1/4/8": "7b=1,32b=4,72b=8",
            "2/4/8": "7b=2,32b=4,72b=8"}
PAPER_GEN_SCALING = (1.0, 0.81, 0.74, 0.69)
"""PAPER.md §1: 7B generation time on 8/16/24/32 GPUs, relative to 8."""


def gen_scaling(max_len: int) -> list[float]:
    est = SimEstimator(get_model("qwen2.5-7b"), get_gpu("H800"), get_gpu("H800"), r1_workload(max_len))
    t = [est.p_gen(x) for x in (8, 16, 24, 32)]
    return [v / t[0] for v in t]


def audit(policy: str) -> dict:
    estimators.set_tp(POLICIES[policy])
    out = e2e_summary()
    out["plan_20k"] = {}
    for model, gpus in (("qwen2.5-32b", 64), ("qwen2.5-72b", 128)):
        est = SimEstimator(get_model(model), get_gpu("H800"), get_gpu("H800"), r1_workload(20000))
        row = plan_single_dc(est, gpus)
        out["plan_20k"][model] = {"gen_gpus": row["gen_gpus"], "tp": row["gen_tp"], "t_gen_s": row["t_gen_s"],
                                  "t_train_s": row["t_train_s"]}
    out["ablation"] = [r["normalized"] for r in E.ablation()]
    rows = E.hetero()
    out["hetero"] = {r["max_len"]: round(r["gain"], 3) for r in rows if r["setup"] == "cross-dc-all"}
    out["hetero_shrunk"] = {r["max_len"]: round(r["gain"], 3) for r in rows if r["setup"] == "cross-dc"}
    out["gen_scaling_7b"] = {ml: gen_scaling(ml) for ml in (5000, 10000, 20000)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = {}
    for policy in POLICIES:
        results[policy] = res = audit(policy)
        r = res["ratios"]
        print(f"== {policy}: ordering broken in {res['ordering_broken']} of 9; splits at 20K "
              f"{ {m.split('-')[-1]: v['gen_gpus'] for m, v in res['plan_20k'].items()} }; ablation "
              f"{[round(x, 3) for x in res['ablation']]}; hetero {res['hetero']}")
        print("   ratios sync/async: " + ", ".join(f"{k.split('@')[0].split('-')[-1]}@{k.split('@')[1].split('/')[0]} "
                                                f"{r[k]:.2f}/{r[k.replace('/sync', '/async')]:.2f}"
                                                for k in r if k.endswith("/sync")))
        print("   7B generation 8/16/24/32 GPUs (paper 1/0.81/0.74/0.69): "
              + "; ".join(f"{ml}: " + "/".join(f"{v:.2f}" for v in s) for ml, s in res["gen_scaling_7b"].items()))
    estimators.set_tp(None)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"policies": POLICIES, "results": results}, f, indent=1, default=str)


if __name__ == "__main__":
    main()

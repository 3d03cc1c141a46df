"""The simulator's mechanisms one at a time (docs/simulator.md, "Mechanisms"): what each one
contributes at paper scale, so a reader can check it against what they know of their cluster.

    python scripts/sim_mechanisms.py [--out FILE.json]

- latency: per-token decode latency against context length (batch 1 and 32) per model and device;
- generation: per e2e configuration and deployment, the makespan against the floor set by the
  longest response decoded alone, requests per instance against the slots one holds, preemptions
  and prefill's share of the instance time;
- training: PAPER.md §1's 7B device scaling against the model with and without the memory-pressure
  term, and 72B's training time on the device counts the planner weighs;
- colocated: what the switches of one colocated iteration cost (resharding, state offload and
  reload) against the iteration;
- verl: the verl row taken apart, one setting at a time, from our colocated system.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace

import numpy as np

from streamrl.lab.sim import cost as C
from streamrl.lab.sim import experiments as E
from streamrl.lab.sim import systems as S
from streamrl.lab.sim.hardware import get_gpu, node_link
from streamrl.lab.sim.models import get_model
from streamrl.lab.sim.workload import r1_workload

MIN_FIT_TP = {"qwen2.5-7b": 1, "qwen2.5-32b": 2, "qwen2.5-72b": 4}


def latency() -> list[dict]:
    rows = []
    for model, gpu, tp in (("qwen2.5-7b", "H800", 1), ("qwen2.5-32b", "H800", 2), ("qwen2.5-72b", "H800", 4),
                           ("qwen2.5-72b", "H800", 8), ("qwen2.5-7b", "H20", 1)):
        dec = C.RooflineDecode(get_gpu(gpu), get_model(model), tp)
        for batch in (1, 32):
            rows.append({"model": model, "gpu": gpu, "tp": tp, "batch": batch,
                         **{f"ms_at_{c // 1000}k": 1000 * dec.step_s(batch, batch * c) for c in (1000, 5000, 10000, 20000)}})
    return rows


def _alone_s(dec, prompt: float, out: float) -> float:
    """One request decoded alone: its prefill, then ``out`` steps at batch 1 with a growing context."""
    steps = np.arange(int(out))
    return dec.prefill_s(prompt) + float(sum(dec.step_s(1, prompt + k) for k in steps[::50]) * 50)


def generation() -> list[dict]:
    rows = []
    for model, gpus in E.E2E_SETUPS:
        for max_len in E.MAX_LENS:
            wl = r1_workload(max_len)
            batch = wl.sample(np.random.default_rng(0))
            history = wl.sample(np.random.default_rng(10_000)).out_lens
            for name in ("colocated", "stream-async"):
                spec = S.get_system(name)
                dep, info = E.deployment_for(spec, model, "H800", gpus, wl)
                dec = dep.decode_cost(spec)
                gen = S.generate(batch, spec, dep, history, 0)
                longest = int(np.argmax(batch.out_lens))
                floor = _alone_s(dec, batch.prompt_lens[longest], batch.out_lens[longest])
                per_seq = float(batch.prompt_lens.mean() + batch.out_lens.mean())
                slots = min(dec.max_batch, int(dec.kv_capacity_tokens // per_seq))
                prefill = float(sum(dec.prefill_s(p) for p in batch.prompt_lens))
                rows.append({"model": model, "max_len": max_len, "system": name, "gen_gpus": info["gen_gpus"], "tp": dep.tp,
                             "makespan_s": gen.makespan_s, "floor_s": floor, "tail_factor": gen.makespan_s / floor,
                             "requests_per_instance": len(batch.out_lens) / dep.instances, "slots_per_instance": slots,
                             "preemptions": gen.preemptions, "prefill_share": prefill / float(gen.busy_s.sum())})
    return rows


def training() -> dict:
    h800 = get_gpu("H800")
    out: dict = {"paper_7b": [1.0, 0.54, 0.30, 0.19]}
    saved = C.KAPPA
    try:
        for kappa in (0.0, 0.55):
            C.KAPPA = kappa
            b7 = r1_workload(10000).sample(np.random.default_rng(0)).seq_lens
            t = [C.RooflineTrain(h800, get_model("qwen2.5-7b"), y).train_s(b7) for y in (8, 16, 24, 32)]
            b72 = r1_workload(20000).sample(np.random.default_rng(0)).seq_lens
            t72 = {y: C.RooflineTrain(h800, get_model("qwen2.5-72b"), y) for y in (48, 64, 80, 96, 128)}
            out[f"kappa_{kappa}"] = {
                "scaling_7b": [x / t[0] for x in t],
                "train_s_72b_20k": {y: tc.train_s(b72) for y, tc in t72.items()},
                "mfu_72b": {y: tc.mfu for y, tc in t72.items()},
            }
    finally:
        C.KAPPA = saved
    return out


def colocated() -> list[dict]:
    rows = []
    spec = S.get_system("colocated")
    for model, gpus in E.E2E_SETUPS:
        for max_len in E.MAX_LENS:
            wl = r1_workload(max_len)
            dep, _ = E.deployment_for(spec, model, "H800", gpus, wl)
            res = S.run_system(spec, dep, wl)
            reshard = dep.model.weight_bytes / dep.tp / node_link(dep.gen_gpu).bandwidth
            offload = 2 * dep.train_cost(spec).offload_s()
            it = 1024 / res.samples_per_s
            rows.append({"model": model, "max_len": max_len, "reshard_s": reshard, "offload_reload_s": offload,
                         "iteration_s": it, "switch_share": (reshard + offload) / it})
    return rows


def verl() -> list[dict]:
    rows = []
    for model, gpus, max_len in (("qwen2.5-7b", 32, 20000), ("qwen2.5-72b", 128, 20000)):
        wl = r1_workload(max_len)
        g, m = get_gpu("H800"), get_model(model)
        tp = E.colocated_tp(model, "H800", gpus, wl)
        base = S.Deployment(m, g, gpus, tp, g, gpus)
        rr = S.SystemSpec("colocated-rr", "colocated", "round-robin", "fifo")
        steps = [
            ("our colocated system", S.get_system("colocated"), base),
            ("+ round-robin dispatch", rr, base),
            ("+ eager decode (no CUDA graphs)", rr, replace(base, decode_override=C.RooflineDecode(g, m, tp, C.KV_MEM_FRACTION, eager=True))),
            ("+ KV cache 0.5 of HBM", rr, replace(base, decode_override=C.RooflineDecode(g, m, tp, 0.5, eager=True))),
            ("+ FSDP MFU x0.85, states resident", rr, replace(base, decode_override=C.RooflineDecode(g, m, tp, 0.5, eager=True),
                                                               train_override=C.RooflineTrain(g, m, gpus, S.VERL_MFU_SCALE))),
            ("verl row", S.get_system("verl"), base),
        ]
        first = None
        for label, spec, dep in steps:
            res = S.run_system(spec, dep, wl)
            first = first or res.samples_per_s
            rows.append({"model": model, "max_len": max_len, "step": label, "samples_per_s": res.samples_per_s,
                         "over_colocated": res.samples_per_s / first, "t_gen_s": res.mean("t_gen"), "t_train_s": res.mean("t_train")})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    out = {"latency": latency(), "generation": generation(), "training": training(), "colocated": colocated(), "verl": verl()}
    for key in ("latency", "generation", "colocated", "verl"):
        print(f"== {key}")
        for r in out[key]:
            print("  " + "  ".join(f"{k}={v:.3f}" if isinstance(v, float) and math.isfinite(v) else f"{k}={v}" for k, v in r.items()))
    print("== training")
    print(json.dumps(out["training"], indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

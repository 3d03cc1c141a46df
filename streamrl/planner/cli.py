"""Handler of ``streamrl plan`` (imported after parsing)."""

from __future__ import annotations

import argparse

from streamrl.metrics.report import print_table, write_json


def run_plan(args: argparse.Namespace) -> int:
    from streamrl.planner.estimators import ProfileEstimator, SimEstimator
    from streamrl.planner.plan import plan_cross_dc, plan_single_dc
    from streamrl.policies.latency import load_profile
    from streamrl.sim.hardware import get_gpu
    from streamrl.sim.models import get_model
    from streamrl.sim.workload import ReplayLengths, Workload, r1_workload

    wl = r1_workload(args.max_len, args.batch)
    if args.lengths_file:
        wl = Workload(ReplayLengths.from_file(args.lengths_file, args.max_len), args.batch)
    keys = {"model": args.model, "max_len": args.max_len}
    if args.profile:
        prof = load_profile(args.profile)
        tps = prof.extra.get("train_tokens_per_s")
        if not tps:
            raise SystemExit(f"streamrl plan: profile {args.profile} has no train_tokens_per_s")
        est = ProfileEstimator(prof, float(tps), wl, instance_devices=args.instance_devices)
        keys["estimator"] = f"profile:{args.profile}"
    else:
        gen_t = args.gen_gpu_type or args.gpu_type
        train_t = args.train_gpu_type or args.gpu_type
        est = SimEstimator(get_model(args.model), get_gpu(gen_t), get_gpu(train_t), wl)
        keys["estimator"] = "simulator"
        keys["gpu"] = gen_t if gen_t == train_t else f"{gen_t}+{train_t}"
    if args.gen_gpus or args.train_gpus:
        if not (args.gen_gpus and args.train_gpus):
            raise SystemExit("streamrl plan: the cross-datacenter form needs both --gen-gpus and --train-gpus")
        row = plan_cross_dc(est, args.gen_gpus, args.train_gpus, **keys)
    else:
        if not args.gpus:
            raise SystemExit("streamrl plan: give --gpus N (one site) or --gen-gpus M --train-gpus N (two sites)")
        row = plan_single_dc(est, args.gpus, **keys)
    print_table("streamrl plan (Algorithm 1)", [row])
    write_json(args.out, {"plan": row})
    return 0

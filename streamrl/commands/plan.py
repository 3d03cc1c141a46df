"""``streamrl plan``: Algorithm 1 (stage balancing) with simulated or measured estimators."""

from __future__ import annotations

import argparse

from streamrl.metrics.report import add_out_argument


def register(subparsers) -> None:
    p: argparse.ArgumentParser = subparsers.add_parser(
        "plan", help="split GPUs between generation and training (Algorithm 1)",
        description="One site: --gpus N --gpu-type T. Two sites: --gen-gpus M --gen-gpu-type H20 "
                    "--train-gpus N --train-gpu-type H800. --profile uses measured numbers instead of the simulator.",
    )
    p.add_argument("--model", default="qwen2.5-7b", help="qwen2.5-7b | qwen2.5-32b | qwen2.5-72b")
    p.add_argument("--gpus", type=int, help="devices in one site")
    p.add_argument("--gpu-type", default="H800", help="H800 | H20 | H200 | A100")
    p.add_argument("--gen-gpus", type=int, help="cross-DC: devices available for generation")
    p.add_argument("--gen-gpu-type", help="cross-DC: generation device type")
    p.add_argument("--train-gpus", type=int, help="cross-DC: devices available for training")
    p.add_argument("--train-gpu-type", help="cross-DC: training device type")
    p.add_argument("--max-len", type=int, default=20000, help="output length cap")
    p.add_argument("--batch", type=int, default=1024, help="prompts per iteration")
    p.add_argument("--lengths-file", help="replay output lengths from this file (csv with response_wtok, or one per line)")
    p.add_argument("--profile", help="measured profile JSON (PTL points + train_tokens_per_s) instead of the simulator")
    p.add_argument("--instance-devices", type=int, default=1, help="with --profile: devices per generation instance")
    p.add_argument("--png", help="plot the predicted stage times over every candidate split to this PNG")
    p.add_argument("--all", action="store_true", help="print every candidate split (default: at most ~24 rows)")
    from streamrl.commands.sim import add_tp_argument

    add_tp_argument(p)
    p.add_argument("--placement-out", metavar="FILE", help="write the chosen split (or, with --cluster, which node "
                   "runs the trainer and each generation instance) as config sections for `streamrl train --plan FILE`")
    p.add_argument("--cluster", metavar="NAME", help="place a run on this labelled cluster (`streamrl cluster up`) "
                   "instead of splitting GPUs: the trainer in --train-site, instances over the other sites' nodes")
    p.add_argument("--train-site", help="with --cluster: the trainer's site (default: the first)")
    p.add_argument("--instances", type=int, help="with --cluster: generation instances (default: one per node)")
    add_out_argument(p)
    p.set_defaults(handler="streamrl.commands.plan:run_plan")


def run_plan(args: argparse.Namespace) -> int:
    if args.cluster:
        return _plan_on_cluster(args)
    from streamrl.commands.sim import apply_tp

    apply_tp(args)
    from streamrl.lab.sim.estimators import ProfileEstimator, SimEstimator
    from streamrl.metrics.report import print_table, write_json
    from streamrl.lab.planner.plan import plan_cross_dc, plan_single_dc, plot_sweep
    from streamrl.scheduling.latency import load_profile
    from streamrl.lab.sim.hardware import get_gpu
    from streamrl.lab.sim.models import get_model
    from streamrl.lab.sim.workload import ReplayLengths, Workload, r1_workload

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
        row, sweep = plan_cross_dc(est, args.gen_gpus, args.train_gpus, sweep=True, **keys)
    else:
        if not args.gpus:
            raise SystemExit("streamrl plan: give --gpus N (one site) or --gen-gpus M --train-gpus N (two sites)")
        row, sweep = plan_single_dc(est, args.gpus, sweep=True, **keys)
    print_table("streamrl plan (Algorithm 1)", [row])
    cands = sweep["candidates"]
    shown = cands if args.all or len(cands) <= 24 else _thin(cands, 24)
    print_table(f"candidate splits ({len(shown)} of {len(cands)}; --all for every one)",
                [{**c, "chosen": "<- chosen" if c["chosen"] else ""} for c in shown],
                ["gen_gpus", "gen_tp", "train_gpus", "t_gen_s", "t_train_s", "t_iter_s", "chosen"])
    flat = sweep["flatness"]
    if flat:
        print(f"optimum: {flat['near_count']} candidate split(s) within {flat['tolerance']:.0%} of the best iteration "
              f"time {flat['best_t_iter_s']:.1f}s: generation {flat['near_gen_min']}-{flat['near_gen_max']} devices, "
              f"training {flat['near_train_min']}-{flat['near_train_max']}"
              + (" (a sharp optimum)" if flat["near_count"] == 1 else ""))
    if args.png:
        cross = bool(args.gen_gpus or args.train_gpus)
        print(f"plot: {plot_sweep(sweep, args.png, title=f'{args.model}, max_len {args.max_len}', cross_dc=cross)}")
    if args.placement_out:
        from streamrl.placement import plan_file_from_split

        cross = bool(args.gen_gpus or args.train_gpus)
        _write_plan(args.placement_out, plan_file_from_split(row, args.gen_gpu_type or args.gpu_type if cross else None,
                                                             args.train_gpu_type or args.gpu_type if cross else None))
    write_json(args.out, {"plan": row, "sweep": sweep})
    return 0


def _write_plan(path: str, sections: dict) -> None:
    from pathlib import Path

    import yaml

    Path(path).write_text("# streamrl train --plan " + path + "\n" + yaml.safe_dump(sections, sort_keys=False))
    print(f"placement plan: {path}")


def _plan_on_cluster(args: argparse.Namespace) -> int:
    from streamrl.lab import cluster as C
    from streamrl.metrics.report import print_table, write_json
    from streamrl.placement import plan_file_for_sites

    cl = C.load(args.cluster)
    sections = plan_file_for_sites([(n.name, n.site) for n in cl.nodes], args.train_site, args.instances)
    p = sections["placement"]
    rows = [{"worker": "trainer", "node": p["trainer_node"], "site": cl.node(p["trainer_node"]).site}]
    for i in range(sections["generation"]["num_instances"]):
        node = p["gen_nodes"][i % len(p["gen_nodes"])]
        rows.append({"worker": f"gen-{i}", "node": node, "site": cl.node(node).site})
    print_table(f"placement on cluster {cl.name}", rows, ["worker", "node", "site"])
    if args.placement_out:
        _write_plan(args.placement_out, sections)
    write_json(args.out, {"placement": sections, "rows": rows})
    return 0


def _thin(cands: list[dict], k: int) -> list[dict]:
    """About ``k`` evenly spaced candidates, always keeping the chosen one and its neighbours."""
    step = max(1, len(cands) // k)
    keep = set(range(0, len(cands), step)) | {len(cands) - 1}
    for i, c in enumerate(cands):
        if c["chosen"]:
            keep |= {i - 1, i, i + 1}
    return [cands[i] for i in sorted(keep) if 0 <= i < len(cands)]

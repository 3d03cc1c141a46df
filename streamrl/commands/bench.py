"""`streamrl bench modes [CONFIG] [overrides]`: throughput of the four pipeline modes."""

from streamrl.metrics.report import add_out_argument


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print tables")
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    p.set_defaults(group_parser=p)
    m = bsub.add_parser("modes", help="run colocated, disagg-batch, stream-sync and stream-async on one workload")
    m.add_argument("config", nargs="?", default="configs/bench.yaml")
    m.add_argument("overrides", nargs="*")
    m.add_argument("--iterations", type=int, default=6, help="timed iterations per mode (default 6)")
    m.add_argument("--warmup", type=int, default=1, help="untimed iterations per mode (default 1)")
    m.add_argument("--modes", default="colocated,disagg-batch,stream-sync,stream-async")
    m.add_argument("--out-dir", default="runs/bench_modes", help="Gantt PNGs and timelines")
    add_out_argument(m)
    m.set_defaults(handler="streamrl.commands.bench:run_modes")


def run_modes(args) -> int:
    from pathlib import Path

    from streamrl.config import load_cli_config

    cfg = load_cli_config(args.config, args.overrides, default="configs/bench.yaml")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from streamrl.bench.modes import bench_modes
    from streamrl.metrics.report import print_table, write_json

    result = bench_modes(cfg, args.warmup, args.iterations, Path(args.out_dir), modes=args.modes.split(","))
    print_table("generation and training tokens/s by thread count", result["thread_scaling"])
    cols = ["mode", "samples_per_s", "tokens_per_s", "step_s", "gen_s", "train_s", "gen_busy", "train_busy",
            "pipeline_efficiency", "speedup_vs_colocated"]
    print_table(f"bench modes: {cfg.trainer.algo}, {cfg.generation.prompts_per_iter} prompts x "
                f"{cfg.generation.n_samples} samples/iter, {args.iterations} timed iterations; training share of "
                f"a disagg-batch step {result['train_share_of_step']:.2f}", result["rows"], cols)
    for r in result["rows"]:
        print(f"  {r['mode']}: Gantt {r['gantt']}")
    write_json(args.out, result)
    return 0

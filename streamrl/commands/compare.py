"""`streamrl compare RUN_DIR [RUN_DIR ...]`: reward curves of finished runs side by side."""

from streamrl.metrics.report import add_out_argument


def register(sub) -> None:
    p = sub.add_parser("compare", help="compare finished runs' reward curves (e.g. stream-sync vs stream-async)")
    p.add_argument("runs", nargs="+", help="run directories written by `streamrl train` (run.out_dir)")
    p.add_argument("--png", default=None, help="write the curves here")
    p.add_argument("--smooth", type=int, default=5, help="moving-average window of the plotted curves")
    add_out_argument(p)
    p.set_defaults(handler="streamrl.commands.compare:run")


def run(args) -> int:
    from streamrl.metrics.curves import compare, load_run, plot
    from streamrl.metrics.report import print_table, write_json

    if args.smooth < 1:
        raise SystemExit(f"--smooth={args.smooth} must be >= 1")
    runs = [load_run(d) for d in args.runs]
    result = compare(runs)
    print_table("runs", result["runs"], ["run", "mode", "seed", "iterations", "reward_first_third",
                                         "reward_last_third", "eval_before", "eval_after"])
    print_table("modes", result["modes"], ["mode", "runs", "reward_last_third_mean", "seed_spread", "eval_after_mean"])
    verdict = result["modes_agree_within_seed_noise"]
    print(f"gap between modes {result['gap_between_modes']:.3f}; seed noise "
          + (f"{result['seed_noise']:.3f}" if result["seed_noise"] is not None else "unknown (one seed per mode)")
          + ("" if verdict is None else f"; modes agree within seed noise: {verdict}"))
    if args.png:
        plot(runs, args.png, smooth=args.smooth)
        print(f"curves: {args.png}")
    write_json(args.out, {**result, "curves": {r["run"]: r["rewards"] for r in runs}})
    return 0

"""`streamrl bench modes|scheduling|faults|soak|agent [CONFIG] [overrides]` and `bench weights`:
pipeline-mode throughput; scheduling makespan; exactly-once and recovery under killed instances
and drivers; memory over a long run; multi-turn throughput; weight updates across a shaped link."""

import argparse
from pathlib import Path

from streamrl.metrics.report import add_out_argument


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks that print tables")
    bsub = p.add_subparsers(dest="bench_command", metavar="SUBCOMMAND")
    p.set_defaults(group_parser=p)
    _register_modes(bsub)
    _register_scheduling(bsub)
    _register_faults(bsub)
    _register_soak(bsub)
    _register_weights(bsub)
    _register_agent(bsub)


def _register_agent(bsub) -> None:
    a = bsub.add_parser("agent", help="multi-turn rollouts: streamed per trajectory against a turn-synchronous loop "
                                      "(every trajectory one turn, then every env step), same instances")
    a.add_argument("config", nargs="?", default="configs/tiny.yaml")
    a.add_argument("overrides", nargs="*")
    a.add_argument("--trajectories", type=int, default=32, help="trajectories per run, one per prompt (32)")
    a.add_argument("--repeats", type=int, default=3, help="runs per system, alternating; the median is shown (3)")
    a.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                   help="the engines' prefix cache (generation.prefix_cache): a trajectory's earlier turns reused (on)")
    a.add_argument("--env", default=None, help="environment class (default streamrl.agent.scripted:SlowChainEnv; "
                                               "ChainEnv: the same turns with no wait)")
    add_out_argument(a)
    a.set_defaults(handler="streamrl.commands.bench:run_agent")


def run_agent(args) -> int:
    from streamrl.config import load_cli_config
    from streamrl.lab.bench.agent import ENV, bench_agent
    from streamrl.metrics.report import print_table, write_json

    env = args.env or ENV
    fixed = [f"task.env={env}", "generation.num_instances=2", "generation.threads_per_instance=1",
             "generation.max_new_tokens=160", "task.max_turns=4", "task.env_workers=8",
             f"generation.prefix_cache={'true' if args.prefix_cache == 'on' else 'false'}"]
    cfg = load_cli_config(args.config, fixed + list(args.overrides), default="configs/tiny.yaml")
    result = bench_agent(cfg, args.trajectories, args.repeats)
    wait = ", a 0.02-0.5 s env step" if env == ENV else ""
    print_table(f"bench agent: {result['trajectories']} trajectories of {env} (1-4 turns{wait}), "
                f"{result['instances']} instances, {result['env_workers']} env workers, greedy; median of "
                f"{result['repeats']} runs; same trajectories in both: {result['same_trajectories']:.2f}",
                result["rows"], ["system", "wall_s", "trajectories", "turns", "sampled_tokens", "trajectories_per_s",
                                 "sampled_tokens_per_s", "speedup"])
    write_json(args.out, result)
    return 0


def _register_modes(bsub) -> None:
    m = bsub.add_parser("modes", help="run colocated, disagg-batch, stream-sync and stream-async on one workload")
    m.add_argument("config", nargs="?", default="configs/bench.yaml")
    m.add_argument("overrides", nargs="*")
    m.add_argument("--iterations", type=int, default=6, help="timed iterations per mode (default 6)")
    m.add_argument("--warmup", type=int, default=1, help="untimed iterations per mode (default 1)")
    m.add_argument("--modes", default="colocated,disagg-batch,stream-sync,stream-async",
                   help="comma list; a mode may take a scheduling variant, e.g. stream-async+skew (skewness-aware "
                        "dispatch, LPT order, the configured ranker)")
    m.add_argument("--colocated-threads", default=None,
                   help="comma list of colocated thread counts; the fastest is the baseline (default: 1 and "
                        "cluster.num_cpus)")
    m.add_argument("--out-dir", default="runs/bench_modes", help="Gantt PNGs and timelines")
    add_out_argument(m)
    m.set_defaults(handler="streamrl.commands.bench:run_modes")


def _register_scheduling(bsub) -> None:
    s = bsub.add_parser("scheduling", help="generation makespan of one batch: random+FIFO vs skewness-aware "
                                           "(ranker / oracle lengths) vs rebalancing, on real instances")
    s.add_argument("config", nargs="?", default="configs/bench.yaml")
    s.add_argument("overrides", nargs="*")
    s.add_argument("--prompts", type=int, default=128, help="distinct prompts in the batch, one response each (128)")
    s.add_argument("--instances", type=int, default=2, help="generation instances, one thread each (2)")
    s.add_argument("--batch", type=int, default=16,
                   help="max_requests_per_batch of each instance (16: a quarter of each instance's share, so "
                        "requests queue and admission order matters; see streamrl.lab.bench.scheduling for other regimes)")
    s.add_argument("--repeats", type=int, default=8,
                   help="runs per configuration (8: one run's makespan varies by ~5%% on this machine)")
    s.add_argument("--batches", type=int, default=1,
                   help="disjoint batches of --prompts prompts, each recorded and run on its own; the table is "
                        "the mean over batches of each batch's ratios (1; one batch's ratios depend on which "
                        "prompts it drew, e.g. whether the ranker misses one that loops to the cap)")
    s.add_argument("--ranker", default="learned", help="ranker fitted on other prompts' lengths (learned)")
    s.add_argument("--ranker-prompts", type=int, default=2048,
                   help="other prompts whose lengths the ranker learns from (2048)")
    s.add_argument("--history-policy", default=None, metavar="DIR",
                   help="an earlier checkpoint of the policy: its greedy lengths on the batch prompts join the "
                        "ranker's data (a later epoch of RL, where history/blend remember each prompt); default: "
                        "none (a first epoch: the batch prompts are unseen)")
    s.add_argument("--profile", default=None, help="PTL profile JSON; default: measure PTL(BS) here first")
    s.add_argument("--configs", default=None, help="comma list of configurations (default: all of them)")
    add_out_argument(s)
    s.set_defaults(handler="streamrl.commands.bench:run_scheduling")


def _register_faults(bsub) -> None:
    f = bsub.add_parser("faults", help="a stream-async run with generation instances and the driver killed at "
                                       "random times, against the same run without: samples lost or trained "
                                       "twice, recovery time per fault, samples/s, held-out accuracy")
    f.add_argument("config", nargs="?", default="configs/tiny.yaml")
    f.add_argument("overrides", nargs="*")
    f.add_argument("--kills", type=int, default=3, help="generation-instance processes killed (SIGKILL) (3)")
    f.add_argument("--restarts", type=int, default=1, help="driver kills (with all its processes) and resumes (1)")
    f.add_argument("--iterations", type=int, default=16, help="RL iterations of each run (16)")
    f.add_argument("--seed", type=int, default=0, help="seed of the fault times and victims (0)")
    f.add_argument("--out-dir", default="runs/bench_faults", help="the two runs' directories and logs")
    add_out_argument(f)
    f.set_defaults(handler="streamrl.commands.bench:run_faults")


def _register_soak(bsub) -> None:
    k = bsub.add_parser("soak", help="one long stream-async run: resident memory and open files of every process "
                                     "over time and their slopes, Ray object-store bytes, files left in /dev/shm")
    k.add_argument("config", nargs="?", default="configs/tiny.yaml")
    k.add_argument("overrides", nargs="*")
    k.add_argument("--iterations", type=int, default=1000, help="RL iterations (1000)")
    k.add_argument("--sample-s", type=float, default=5.0, help="seconds between process samples (5)")
    k.add_argument("--out-dir", default="runs/bench_soak", help="the run's directory and log")
    add_out_argument(k)
    k.set_defaults(handler="streamrl.commands.bench:run_soak")


def _register_weights(bsub) -> None:
    w = bsub.add_parser("weights", help="one weight update at a time across a shaped link between two sites: "
                                        "naive, tree (one copy per site), tree+delta; bytes from the link's counters")
    w.add_argument("--sites", default="A:1,B:2", help="sites to build (default A:1,B:2: the trainer in A, a "
                                                      "receiver on each node of B)")
    w.add_argument("--link", default="A-B:200mbit", help="the shaped link (default A-B:200mbit)")
    w.add_argument("--cluster", default=None, help="use this cluster (`streamrl cluster up`) instead of building one")
    w.add_argument("--per-node", type=int, default=1, help="receivers per remote node (1)")
    w.add_argument("--vocab", type=int, default=32000)
    w.add_argument("--hidden", type=int, default=768)
    w.add_argument("--layers", type=int, default=12)
    w.add_argument("--heads", type=int, default=12)
    w.add_argument("--kv-heads", type=int, default=4)
    w.add_argument("--intermediate", type=int, default=2048,
                   help="with the defaults above: a 100M-parameter Qwen2 shape, 400 MB fp32, 200 MB bf16")
    w.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank and send only them "
                                                           "(0 = every weight)")
    w.add_argument("--updates", type=int, default=3, help="timed updates per method (3)")
    w.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate of the timed updates (1e-6)")
    w.add_argument("--demo-lr", type=float, default=None,
                   help="also report the delta fraction at this learning rate (default: configs/tiny.yaml's)")
    w.add_argument("--wire", default="bfloat16", choices=["float32", "bfloat16"], help="wire dtype (bfloat16)")
    w.add_argument("--bucket-mb", type=float, default=16.0)
    w.add_argument("--fanout", type=int, default=2)
    w.add_argument("--methods", default="naive,tree,tree+delta")
    w.add_argument("--threads", type=int, default=2, help="torch threads of the trainer (2)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--object-store-mb", type=int, default=1536, help="object store of each node (1536)")
    w.add_argument("--timeout-s", type=float, default=1800.0)
    w.add_argument("--run", metavar="RUN_DIR", default=None, help="instead: the weight transfers of a finished run, "
                   "per version (bytes across sites, fetch, pause, overlap with training), from its timeline")
    w.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)  # the run inside the head's namespace
    add_out_argument(w)
    w.set_defaults(handler="streamrl.commands.bench:run_weights")


def run_weights(args) -> int:
    from streamrl.lab.bench.weights import METHODS
    from streamrl.metrics.report import print_table, write_json

    if args.run:
        from streamrl.lab.bench.weights import run_transfers

        rows = run_transfers(args.run)
        print_table(f"weight transfers of {args.run}, per version", rows,
                    ["version", "instances", "kinds", "cross_site_bytes", "cross_site_fetch_s", "all_instances_s",
                     "pause_s", "overlap_with_training"])
        write_json(args.out, {"run": args.run, "rows": rows})
        return 0
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        from streamrl.errors import UserError

        raise UserError(f"--methods: unknown {bad}; choose from {', '.join(METHODS)}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        from streamrl.errors import UserError

        raise UserError(f"--hidden={args.hidden} must be a multiple of --heads={args.heads}, and --heads of "
                        f"--kv-heads={args.kv_heads}")
    if args.demo_lr is None:
        from streamrl.config import load_config

        args.demo_lr = load_config("configs/tiny.yaml", []).trainer.lr if Path("configs/tiny.yaml").exists() else None
    if args.inside:
        from streamrl.lab.bench.weights import run_inside

        write_json(args.out, run_inside(args.cluster, args))
        return 0
    from streamrl.lab.bench.weights import bench_weights

    args.passthrough = [f"--per-node={args.per_node}", f"--vocab={args.vocab}", f"--hidden={args.hidden}",
                        f"--layers={args.layers}", f"--heads={args.heads}", f"--kv-heads={args.kv_heads}",
                        f"--intermediate={args.intermediate}", f"--updates={args.updates}", f"--lr={args.lr}",
                        f"--lora-rank={args.lora_rank}",
                        f"--wire={args.wire}", f"--bucket-mb={args.bucket_mb}", f"--fanout={args.fanout}",
                        f"--methods={','.join(args.methods)}", f"--threads={args.threads}", f"--seed={args.seed}"]
    if args.demo_lr:
        args.passthrough.append(f"--demo-lr={args.demo_lr}")
    result = bench_weights(args)
    rows = [{**r, "site_bytes_per_update": ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in r["site_bytes_per_update"].items())}
            for r in result["rows"]]
    lora = f", LoRA rank {args.lora_rank} (adapters only)" if args.lora_rank else ""
    print_table(f"bench weights: {result['params'] / 1e6:.0f}M parameters{lora}, {result['wire_dtype']} on the wire, "
                f"AdamW lr {result['lr']:g}, trainer in {result['trainer'][1]}, "
                f"{len(result['receivers'])} receivers in {sorted({s for _, s in result['receivers'].values()})}",
                rows, ["method", "model_bytes", "planned_copies", "slow_link_bytes_per_update",
                       "slow_link_copies_per_update", "site_bytes_per_update", "link_limit_bytes_per_s",
                       "achieved_bytes_per_s", "achieved_of_limit", "all_instances_s", "generation_pause_s",
                       "delta_fraction"])
    if result.get("demo_lr"):
        d = result["demo_lr"]
        print(f"delta fraction at lr {d['lr']:g} (configs/tiny.yaml): " + ", ".join(f"{x:.3f}" for x in d["delta_fractions"]))
    write_json(args.out, result)
    return 0


def run_modes(args) -> int:
    from pathlib import Path

    from streamrl.config import load_cli_config

    cfg = load_cli_config(args.config, args.overrides, default="configs/bench.yaml")
    import logging

    logging.basicConfig(level=logging.WARNING)
    from streamrl.lab.bench.modes import bench_modes
    from streamrl.metrics.report import print_table, write_json

    threads = tuple(int(t) for t in args.colocated_threads.split(",")) if args.colocated_threads else None
    from streamrl.metrics import progress

    with progress.bar("bench modes: runs"):
        result = bench_modes(cfg, args.warmup, args.iterations, Path(args.out_dir), modes=args.modes.split(","),
                             colocated_threads=threads)
    print_table("generation and training tokens/s by thread count", result["thread_scaling"])
    cols = ["mode", "samples_per_s", "tokens_per_s", "step_s", "gen_s", "train_s", "gen_busy", "train_busy",
            "pipeline_efficiency", "speedup_vs_colocated"]
    if any("rank/spearman" in r for r in result["rows"]):
        cols += ["rank/recall@20%", "rank/recall@10%", "rank/recall@5%", "rank/spearman"]
    print_table(f"bench modes: {cfg.trainer.algo}, {cfg.generation.prompts_per_iter} prompts x "
                f"{cfg.generation.n_samples} samples/iter, {args.iterations} timed iterations; training share of "
                f"a disagg-batch step {result['train_share_of_step']:.2f}", result["rows"], cols)
    if result["colocated_by_threads"]:
        by = ", ".join(f"{t} thread(s) {v:.2f}" for t, v in sorted(result["colocated_by_threads"].items()))
        print(f"colocated samples/s by thread count: {by}; the fastest is the baseline")
    for r in result["rows"]:
        print(f"  {r['mode']}: Gantt {r['gantt']}")
    write_json(args.out, result)
    return 0


def run_scheduling(args) -> int:
    import logging

    from streamrl.config import load_cli_config

    cfg = load_cli_config(args.config, args.overrides, default="configs/bench.yaml")
    logging.basicConfig(level=logging.WARNING)
    from streamrl.lab.bench.scheduling import CONFIGS, bench_scheduling
    from streamrl.metrics.report import print_table, write_json

    configs = CONFIGS
    if args.configs:
        by_name = {c.name: c for c in CONFIGS}
        names = [n.strip() for n in args.configs.split(",") if n.strip()]
        unknown = [n for n in names if n not in by_name]
        if unknown:
            raise SystemExit(f"streamrl bench scheduling: unknown --configs {unknown}; known: {list(by_name)}")
        configs = tuple(by_name[n] for n in names)
    from streamrl.metrics import progress

    with progress.bar("bench scheduling: batches", total=args.batches):
        result = bench_scheduling(cfg, prompts=args.prompts, instances=args.instances, batch=args.batch,
                                  repeats=args.repeats, ranker=args.ranker, ranker_prompts=args.ranker_prompts,
                                  profile=args.profile, configs=configs, history_policy=args.history_policy,
                                  batches=args.batches)
    su, lb = result["setup"], result["lower_bound"]
    fitted = f"{result['ranker']['train_prompts']} other prompts"
    ranker_rows = [result["ranker"]]
    if args.history_policy:
        fitted += f" + the batch prompts' lengths under {args.history_policy}"
        ranker_rows.append({"ranker": "history policy's lengths alone", **result["ranker"]["history_alone"]})
    print_table(f"ranker ({args.ranker}, fitted on {fitted}) on the batch",
                ranker_rows, ["ranker", "recall@20%", "recall@10%", "recall@5%", "spearman", "fit_s", "score_s"])
    if su["batches"] > 1:
        pbs = result["per_batch"]
        print_table("per batch: random+fifo makespan and the ranker on the batch",
                    [{"batch": pb["batch"], "random+fifo_s": next(r["makespan_s"] for r in pb["rows"] if r["config"] == "random+fifo"),
                      "max_len": pb["stats"]["max_len"], **{k: pb["ranker"][k] for k in ("recall@20%", "recall@10%", "recall@5%", "spearman")}}
                     for pb in pbs])
        print_table("wall makespan / random+fifo, per batch and their mean",
                    [{"config": r["config"], **{f"batch {pb['batch']}": v for pb, v in zip(pbs, r["vs_random_fifo_by_batch"])},
                      "mean": r["vs_random_fifo"]} for r in result["rows"]])
    print_table(f"bench scheduling: {su['batches']} x {su['prompts']} prompts (greedy, mean {su['mean_len']:.0f} / p90 {su['p90_len']:.0f} / "
                f"max {su['max_len']} tokens) on {su['instances']} instances, batch {su['batch']}, {su['repeats']} runs "
                f"each; lower bound {lb['lower_bound_s']:.2f}s (longest alone {lb['longest_alone_s']:.2f}s, all tokens at "
                f"peak {lb['all_tokens_at_peak_s']:.2f}s, of which context {lb['context_s']:.2f}s)", result["rows"],
                ["config", "makespan_s", "makespan_min_s", "makespan_max_s", "vs_random_fifo", "vs_lower_bound",
                 "cpu_makespan_s", "cpu_vs_random_fifo", "moved", "moved_running", "length_match"])
    print_table("targets", result["checks"], ["check", "value", "met"])
    write_json(args.out, result)
    return 0


def run_faults(args) -> int:
    from pathlib import Path

    from streamrl.config import load_cli_config

    # Checkpoints every 2 iterations (a restart resumes from one), a smaller held-out set (the
    # accuracy is compared between the runs, not reported alone); the user's overrides come last.
    fixed = ["mode=stream-async", f"run.iterations={args.iterations}", "run.checkpoint_every=2", "task.num_eval=64"]
    overrides = fixed + list(args.overrides)
    cfg = load_cli_config(args.config, overrides, default="configs/tiny.yaml")
    from streamrl.lab.bench.faults import bench_faults
    from streamrl.controller.setup import ensure_policy
    from streamrl.metrics.report import print_table, write_json

    ensure_policy(cfg)  # built once here, not inside the timed runs
    result = bench_faults(cfg, [args.config, *overrides], Path(args.out_dir), args.kills, args.restarts, args.seed)
    print_table("bench faults: the same stream-async run without and with faults", result["rows"],
                ["run", "kills", "restarts", "prompts_scheduled", "prompts_lost", "prompts_trained_twice",
                 "samples_trained", "wall_s", "samples_per_s", "eval_accuracy_after", "leftover_processes"])
    print_table("faults (seconds from the fault)", result["faults"],
                ["kind", "attempt", "pid", "resumed", "detected_s", "requeued", "recovery_s"])
    print(f"samples/s with faults / without: {result['samples_per_s_ratio']:.3f}; prompts lost "
          f"{result['prompts_lost']}, trained twice {result['prompts_trained_twice']}")
    write_json(args.out, result)
    return 0


def run_soak(args) -> int:
    from pathlib import Path

    from streamrl.config import load_cli_config

    # Small iterations (4 prompts x 4 samples of <= 64 tokens): a leak shows per iteration, so
    # many short iterations find it sooner; a checkpoint every 50 exercises that path too.
    fixed = ["mode=stream-async", f"run.iterations={args.iterations}", "generation.prompts_per_iter=4",
             "generation.n_samples=4", "generation.max_new_tokens=64", "task.num_eval=16", "run.eval_samples=1",
             "run.checkpoint_every=50"]
    overrides = fixed + list(args.overrides)
    cfg = load_cli_config(args.config, overrides, default="configs/tiny.yaml")
    from streamrl.lab.bench.faults import bench_soak
    from streamrl.controller.setup import ensure_policy
    from streamrl.metrics.report import print_table, write_json

    ensure_policy(cfg)
    result = bench_soak([args.config, *overrides], Path(args.out_dir), args.sample_s)
    print_table(f"bench soak: {result['iterations']} stream-async iterations in {result['wall_s']:.0f}s; slopes "
                "over the second half", result["processes"],
                ["role", "processes", "rss_mb_first", "rss_mb_last", "rss_mb_per_100_iter", "rss_mb_floor_per_100_iter",
                 "rss_mb_after_loop", "open_files_last", "open_files_per_100_iter"])
    blocks = sorted({b for r in result["processes"] for b in r["rss_mb_per_block"]}, key=int)
    shown = blocks[::max(1, -(-len(blocks) // 10))]  # at most 10 columns
    for key, what in (("rss_mb_per_block", "mean"), ("rss_mb_floor_per_block", "lowest sample")):
        print_table(f"resident memory, {what} of each block of 100 iterations (MB)",
                    [{"role": r["role"], **{f"it. {b}": r[key].get(b, "") for b in shown}}
                     for r in result["processes"]], ["role", *[f"it. {b}" for b in shown]])
    print(f"object store: {result['object_store_mb_first']:.1f} MB at the first iteration, "
          f"{result['object_store_mb_last']:.1f} MB at the last ({result['object_store_objects_last']} objects), "
          f"{result['object_store_mb_per_100_iter']:+.2f} MB per 100 iterations; /dev/shm files "
          f"{result['shm_files_before']} before, {result['shm_files_after']} after (new: {result['shm_new_files']}); "
          f"processes left: {result['leftover_processes']}")
    write_json(args.out, result)
    return 0

"""``streamrl simulate e2e | ablation | hetero | elastic | modes``: the paper-scale simulator, and the
tiny CPU workload from a measured profile (``modes``)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

from streamrl.metrics.report import add_out_argument, print_table, write_json


def _common(p: argparse.ArgumentParser, iterations: int = 4) -> None:
    p.add_argument("--iterations", type=int, default=iterations, help="RL iterations to simulate")
    p.add_argument("--seed", type=int, default=0)
    add_tp_argument(p)
    add_out_argument(p)


def add_tp_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", default=None, metavar="POLICY|MODEL=TP,...",
                   help="generation instances' tensor parallelism: min-fit (default: the smallest degree that "
                        "fits), search (the fastest, per device count), or fixed per model, e.g. 7b=1,32b=4,72b=8")


def apply_tp(args: argparse.Namespace) -> None:
    """Set the simulator's TP policy from ``--tp`` (a bad entry is a user error)."""
    from streamrl.errors import UserError
    from streamrl.lab.sim import estimators

    try:
        estimators.set_tp(getattr(args, "tp", None))
    except ValueError as exc:
        raise UserError(str(exc)) from None


def register(subparsers) -> None:
    group = subparsers.add_parser("simulate", help="discrete-event simulation at paper scale")
    sub = group.add_subparsers(dest="sim_command", metavar="EXPERIMENT")
    group.set_defaults(group_parser=group)

    p = sub.add_parser("e2e", help="throughput of each system: 7B/32B/72B on 32/64/128 H800 at 5K/10K/20K")
    p.add_argument("--models", help="comma list to keep, e.g. 7b,32b (default: all three)")
    p.add_argument("--max-lens", help="comma list, e.g. 5000,20000 (default: 5000,10000,20000)")
    p.add_argument("--systems", help="comma list of systems (default: verl,colocated,stream-sync,stream-async,...)")
    _common(p)
    p.set_defaults(handler="streamrl.commands.sim:run_e2e")

    p = sub.add_parser("ablation", help="colocated -> +skewness-aware -> +disaggregation/streaming -> +async")
    p.add_argument("--model", default="qwen2.5-72b")
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--max-len", type=int, default=20000)
    _common(p)
    p.set_defaults(handler="streamrl.commands.sim:run_ablation")

    p = sub.add_parser("hetero", help="32xH20 + 16xH800 in two sites vs 32xH800 in one: throughput per cost")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--max-lens", help="comma list (default: 5000,10000,20000)")
    p.add_argument("--system", default="stream-async")
    _common(p)
    p.set_defaults(handler="streamrl.commands.sim:run_hetero")

    p = sub.add_parser("elastic", help="output length grows 10K->20K; the elastic rule adds generation instances")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--start-len", type=int, default=10000)
    p.add_argument("--end-len", type=int, default=20000)
    p.add_argument("--png", help="plot of delta and GPUs (default: next to --out)")
    _common(p, iterations=24)
    p.set_defaults(handler="streamrl.commands.sim:run_elastic")

    p = sub.add_parser("modes", help="the tiny CPU bench workload from a measured profile; vs `bench modes` with --bench",
                       description="Simulates colocated, disagg-batch, stream-sync and stream-async on the workload of "
                                   "CONFIG (default configs/bench.yaml) with the costs measured by `streamrl profile`; with "
                                   "--bench, prints the measured values of `streamrl bench modes --out` and the ratio.")
    p.add_argument("config", nargs="?", default="configs/bench.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--profile", required=True, help="profile JSON written by `streamrl profile`")
    p.add_argument("--bench", help="JSON written by `streamrl bench modes --out`")
    p.add_argument("--lengths", help="output lengths: JSONL/samples file (a length key or output_ids per row) or numbers")
    p.add_argument("--modes", help="comma list (default colocated,disagg-batch,stream-sync,stream-async)")
    p.add_argument("--iterations", type=int, default=0, help="iterations (default: the bench's, else 6)")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    p.set_defaults(handler="streamrl.commands.sim:run_modes")


@contextlib.contextmanager
def _progress(total: int) -> Iterator[Callable[[str], None]]:
    from rich.progress import Progress

    with Progress(transient=True) as prog:
        task = prog.add_task("simulating", total=total)

        def step(msg: str) -> None:
            prog.update(task, advance=1, description=msg)

        yield step


def _split(arg: str | None, cast=str) -> tuple | None:
    return tuple(cast(x) for x in arg.split(",")) if arg else None


def run_e2e(args: argparse.Namespace) -> int:
    from streamrl.lab.sim import experiments as E

    apply_tp(args)

    setups = E.E2E_SETUPS
    if args.models:
        keep = set(_split(args.models))
        setups = tuple(s for s in setups if s[0] in keep or s[0].split("-")[-1] in keep)
    lens = _split(args.max_lens, int) or E.MAX_LENS
    systems = _split(args.systems) or E.E2E_SYSTEMS
    with _progress(len(setups) * len(lens) * len(systems)) as step:
        rows = E.e2e(setups, lens, systems, iterations=args.iterations, seed=args.seed, progress=step)
    cols = ["model", "gpus", "max_len", "system", "samples_per_s", "gen_gpus", "train_gpus", "tp", "t_gen_s", "t_train_s", "limit"]
    print_table("simulate e2e: PPO, 1024 prompts/iteration, H800", rows, cols)
    write_json(args.out, {"rows": rows})
    return 0


def run_ablation(args: argparse.Namespace) -> int:
    from streamrl.lab.sim import experiments as E

    apply_tp(args)

    with _progress(4) as step:
        rows = E.ablation(args.model, args.gpus, args.max_len, iterations=args.iterations, seed=args.seed, progress=step)
    cols = ["step", "system", "samples_per_s", "normalized", "gen_gpus", "train_gpus", "tp", "t_gen_s", "t_train_s", "limit"]
    print_table(f"simulate ablation: {args.model} on {args.gpus} x H800, max_len {args.max_len}", rows, cols)
    write_json(args.out, {"rows": rows})
    return 0


def run_hetero(args: argparse.Namespace) -> int:
    from streamrl.lab.sim import experiments as E

    apply_tp(args)

    lens = _split(args.max_lens, int) or E.MAX_LENS
    with _progress(3 * len(lens)) as step:
        rows = E.hetero(args.model, lens, args.system, iterations=args.iterations, seed=args.seed, progress=step)
    cols = ["setup", "max_len", "gen", "train", "tp", "samples_per_s", "cost", "samples_per_s_per_cost", "gain", "t_gen_s", "t_train_s", "limit"]
    print_table("simulate hetero: 32xH20 + 16xH800 across sites (80 Gbps) vs 32xH800", rows, cols)
    write_json(args.out, {"rows": rows})
    return 0


def run_elastic(args: argparse.Namespace) -> int:
    from streamrl.lab.sim import experiments as E

    apply_tp(args)

    with _progress(args.iterations) as step:
        res = E.elastic(args.model, args.gpus, args.start_len, args.end_len, args.iterations, seed=args.seed, progress=step)
    print_table(f"simulate elastic: {args.model} from {args.gpus} GPUs, length {args.start_len}->{args.end_len}",
                res["iterations"], ["i", "max_len", "gen_gpus", "train_gpus", "t_gen_s", "t_train_s", "delta_s", "delta_prime_s", "added"])
    write_json(args.out, res)
    png = args.png or (str(Path(args.out).with_suffix(".png")) if args.out else None)
    if png:
        _plot_elastic(res, png)
        print(f"wrote {png}")
    return 0


def _plot_elastic(res: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    it = res["iterations"]
    xs = [r["i"] for r in it]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [r["delta_s"] for r in it], label="delta = T_gen - T_train (s)")
    ax.plot(xs, [r["delta_prime_s"] for r in it], "--", label="delta' (one more instance saves, s)")
    ax.set_xlabel("iteration")
    ax.set_ylabel("seconds")
    ax2 = ax.twinx()
    ax2.step(xs, [r["gen_gpus"] for r in it], "g", where="post", label="generation GPUs")
    ax2.set_ylabel("generation GPUs")
    fig.legend(loc="upper left")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)


def run_modes(args: argparse.Namespace) -> int:
    """``streamrl simulate modes``: the tiny CPU workload from a measured profile, vs the bench."""
    import json
    import sys

    from streamrl.config import load_cli_config
    from streamrl.lab.profiling.live import DEFAULT_CONFIG
    from streamrl.lab.sim import live

    cfg = load_cli_config(args.config, args.overrides, default=DEFAULT_CONFIG)
    try:
        profile = json.loads(Path(args.profile).read_text())
    except FileNotFoundError:
        print(f"streamrl simulate modes: profile {args.profile!r} not found (write it with `streamrl profile`)", file=sys.stderr)
        return 2
    bench = json.loads(Path(args.bench).read_text()) if args.bench else None
    g = cfg.generation
    lengths, source = None, ""
    if bench is not None:
        lengths = live.bench_lengths(bench)
        source = f"bench JSON {args.bench}"
    if lengths is None and args.lengths:
        lengths, source = live.lengths_from_file(args.lengths), f"lengths file {args.lengths}"
    if lengths is None and profile.get("sample_out_lens"):
        lengths, source = [float(x) for x in profile["sample_out_lens"]], f"profile {args.profile} (sample_out_lens)"
    if lengths is None:
        lengths = live.synthetic_lengths(cfg.task.num_train, cfg.run.seed)
        source = "synthetic task reference solutions (+1 EOS)"
    # the workload's prompt length: given, else recorded by the bench, else the profile's (its task at profiling time)
    prompt_len, prompt_src = getattr(args, "prompt_len", None), "given"
    if not prompt_len and bench is not None and bench.get("prompt_len_mean"):
        prompt_len, prompt_src = float(bench["prompt_len_mean"]), f"bench JSON {args.bench}"
    if not prompt_len:
        prompt_len, prompt_src = profile.get("prompt_len_mean"), f"profile {args.profile}"
    if not prompt_len:
        prompt_len, prompt_src = live.synthetic_prompt_len(cfg.task.num_train, cfg.run.seed), "synthetic task prompts"
    iterations = args.iterations or (int(bench["iterations"]) if bench and bench.get("iterations") else 6)
    modes = _split(args.modes) or live.MODES
    res = live.simulate_tiny_modes(
        profile, prompts_per_iter=g.prompts_per_iter, n_samples=g.n_samples, max_new_tokens=g.max_new_tokens,
        lengths=lengths, prompt_len=float(prompt_len), step_tokens=cfg.trainer.step_tokens,
        num_instances=g.num_instances, max_batch=g.max_requests_per_batch, dispatch=g.dispatch,
        iterations=iterations, seed=args.seed, modes=modes,
        colocated_threads=cfg.cluster.num_cpus, thread_scaling=(bench or {}).get("thread_scaling"))
    res["assumptions"]["lengths_source"] = source
    res["assumptions"]["prompt_len_source"] = prompt_src
    res["profile"] = args.profile
    rows = res["rows"]
    cols = ["mode", "sim_samples_per_s", "sim_step_s", "sim_gen_s", "sim_train_s"]
    if bench is not None:
        rows = live.compare_with_bench(rows, bench)
        res["rows"], res["bench"] = rows, args.bench
        cols += ["meas_samples_per_s", "meas_step_s", "ratio", "within_20pct", "sim_mean_len", "meas_mean_len"]
    a = res["assumptions"]
    print_table(f"simulate modes: {a['requests_per_iter']} requests/iter ({g.prompts_per_iter} prompts x {g.n_samples}), "
                f"{a['instances']} instance(s) + 1 trainer CPU, profile {args.profile}", rows, cols)
    print(f"  prompt {a['prompt_len']:.1f} tokens; output lengths from {source}: mean {a['mean_out_len']:.1f}, "
          f"cap {a['max_new_tokens']}; engine batch <= {a['max_batch']}, FIFO admission, admission + prefill "
          f"{a['prefill_s_per_request'] * 1e3:.2f} ms/request ({a['colocated_prefill_s_per_request'] * 1e3:.2f} colocated); "
          f"context cost {a['kv_ms_per_token'] * 1e3:.2f} us per running token beyond {a['ptl_context']:.0f} per request "
          f"({a['colocated_kv_ms_per_token'] * 1e3:.2f} colocated)")
    print(f"  trainer {a['trainer']} (= {a['train_tokens_per_s']:.0f} tokens/s on an iteration of mean sequences prepared in one call); "
          f"stream modes: an optimizer step per {a['stream_min_batch_tokens']} buffered tokens; "
          f"{a['iterations']} iterations from an idle pipeline; weight push {a['weight_push_s'] * 1e3:.2f} ms")
    print(f"  colocated ({a['colocated_threads']} threads): {a['colocated_source']}; "
          f"trainer {a['colocated_train_tokens_per_s']:.0f} tokens/s on an iteration of mean sequences in one call; "
          f"switch (weight install) {a['colocated_switch_s'] * 1e3:.0f} ms")
    if bench is not None:
        print("  ratio = simulated / measured samples/s (step time is its inverse); within_20pct: |ratio - 1| <= 0.2")
    write_json(args.out, res)
    return 0

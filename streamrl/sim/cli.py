"""Handlers of ``streamrl simulate e2e | ablation | hetero | elastic`` (imported after parsing)."""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path
from typing import Any, Callable, Iterator

from streamrl.metrics.report import print_table, write_json


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
    from streamrl.sim import experiments as E

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
    from streamrl.sim import experiments as E

    with _progress(4) as step:
        rows = E.ablation(args.model, args.gpus, args.max_len, iterations=args.iterations, seed=args.seed, progress=step)
    cols = ["step", "system", "samples_per_s", "normalized", "gen_gpus", "train_gpus", "tp", "t_gen_s", "t_train_s", "limit"]
    print_table(f"simulate ablation: {args.model} on {args.gpus} x H800, max_len {args.max_len}", rows, cols)
    write_json(args.out, {"rows": rows})
    return 0


def run_hetero(args: argparse.Namespace) -> int:
    from streamrl.sim import experiments as E

    lens = _split(args.max_lens, int) or E.MAX_LENS
    with _progress(2 * len(lens)) as step:
        rows = E.hetero(args.model, lens, args.system, iterations=args.iterations, seed=args.seed, progress=step)
    cols = ["setup", "max_len", "gen", "train", "tp", "samples_per_s", "cost", "samples_per_s_per_cost", "t_gen_s", "t_train_s", "limit"]
    print_table("simulate hetero: 32xH20 + 16xH800 across sites (80 Gbps) vs 32xH800", rows, cols)
    write_json(args.out, {"rows": rows})
    return 0


def run_elastic(args: argparse.Namespace) -> int:
    from streamrl.sim import experiments as E

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

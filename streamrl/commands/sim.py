"""``streamrl simulate e2e | ablation | hetero | elastic | modes``: the paper-scale simulator, and the
tiny CPU workload from a measured profile (``modes``)."""

from __future__ import annotations

import argparse

from streamrl.metrics.report import add_out_argument


def _common(p: argparse.ArgumentParser, iterations: int = 4) -> None:
    p.add_argument("--iterations", type=int, default=iterations, help="RL iterations to simulate")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)


def register(subparsers) -> None:
    group = subparsers.add_parser("simulate", help="discrete-event simulation at paper scale")
    sub = group.add_subparsers(dest="sim_command", metavar="EXPERIMENT")
    group.set_defaults(group_parser=group)

    p = sub.add_parser("e2e", help="throughput of each system: 7B/32B/72B on 32/64/128 H800 at 5K/10K/20K")
    p.add_argument("--models", help="comma list to keep, e.g. 7b,32b (default: all three)")
    p.add_argument("--max-lens", help="comma list, e.g. 5000,20000 (default: 5000,10000,20000)")
    p.add_argument("--systems", help="comma list of systems (default: verl,colocated,stream-sync,stream-async,...)")
    _common(p)
    p.set_defaults(handler="streamrl.sim.cli:run_e2e")

    p = sub.add_parser("ablation", help="colocated -> +skewness-aware -> +disaggregation/streaming -> +async")
    p.add_argument("--model", default="qwen2.5-72b")
    p.add_argument("--gpus", type=int, default=128)
    p.add_argument("--max-len", type=int, default=20000)
    _common(p)
    p.set_defaults(handler="streamrl.sim.cli:run_ablation")

    p = sub.add_parser("hetero", help="32xH20 + 16xH800 in two sites vs 32xH800 in one: throughput per cost")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--max-lens", help="comma list (default: 5000,10000,20000)")
    p.add_argument("--system", default="stream-async")
    _common(p)
    p.set_defaults(handler="streamrl.sim.cli:run_hetero")

    p = sub.add_parser("elastic", help="output length grows 10K->20K; the elastic rule adds generation instances")
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--gpus", type=int, default=32)
    p.add_argument("--start-len", type=int, default=10000)
    p.add_argument("--end-len", type=int, default=20000)
    p.add_argument("--png", help="plot of delta and GPUs (default: next to --out)")
    _common(p, iterations=24)
    p.set_defaults(handler="streamrl.sim.cli:run_elastic")

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
    p.set_defaults(handler="streamrl.sim.cli:run_modes")

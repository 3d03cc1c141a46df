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
    add_out_argument(p)
    p.set_defaults(handler="streamrl.planner.cli:run_plan")

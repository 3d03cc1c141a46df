"""The `streamrl` command line.

Only argparse is imported here: each command module registers its sub-parser with a
``"module:function"`` handler string, and the heavy module (torch, Ray, transformers) is
imported after parsing, so ``streamrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# Each module defines ``register(subparsers)``; keep them free of heavy imports.
COMMAND_MODULES = (
    "streamrl.commands.train",
    "streamrl.commands.policy",
    "streamrl.commands.task",
    "streamrl.commands.bench",
    "streamrl.commands.rank",
    "streamrl.commands.sim",
    "streamrl.commands.plan",
    "streamrl.commands.profile",
    "streamrl.commands.compare",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl",
        description="RL post-training of LLMs with disaggregated stream generation (StreamRL).",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # a command not built yet
                continue
            raise
        module.register(sub)
    return parser


def run_handler(handler: str, args: argparse.Namespace) -> int:
    module_name, func_name = handler.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(args)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    handler = getattr(args, "handler", None)
    if handler is None:
        # A group command (e.g. `streamrl simulate`) without its sub-command.
        sub_parser = getattr(args, "group_parser", parser)
        sub_parser.print_help()
        return 2
    from streamrl.config import ConfigError

    try:
        return run_handler(handler, args)
    except ConfigError as exc:
        print(f"streamrl: config error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

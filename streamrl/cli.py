"""The `streamrl` command line.

Only argparse is imported here: each command module registers its sub-parser with a
``"module:function"`` handler string, and the heavy module (torch, Ray, transformers) is
imported after parsing, so ``streamrl --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from streamrl.errors import RunFailure, RunInterrupted, UserError

# Errors in the user's input: one line naming what is wrong and exit status 2 (`--debug`: the
# traceback). A missing or unreadable file is nearly always one the user named (a config, a
# data file, a run directory), so these OS errors count too.
USER_ERRORS = (UserError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError)

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
    "streamrl.commands.config",
    "streamrl.commands.cluster",
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="streamrl",
        description="RL post-training of LLMs with disaggregated stream generation (StreamRL).",
    )
    parser.add_argument("--debug", action="store_true",
                        help="on an error in your input (config, data, paths), show the traceback instead of one line")
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


def format_user_error(exc: BaseException) -> str:
    """The one line the CLI prints for a mistake in the user's input."""
    if isinstance(exc, OSError) and not isinstance(exc, UserError) and exc.filename is not None:
        return f"streamrl: error: {exc.strerror or exc}: {str(exc.filename)!r}"
    return f"streamrl: {getattr(exc, 'label', 'error')}: {exc}"


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # key=value overrides after an option (`train CONFIG --plan F a.b=1`): argparse stops filling a
    # positional list at the first option, so such overrides come back unparsed; they join the list.
    if extra and isinstance(getattr(args, "overrides", None), list) and all("=" in x and not x.startswith("-") for x in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    handler = getattr(args, "handler", None)
    if handler is None:
        # A group command (e.g. `streamrl simulate`) without its sub-command.
        sub_parser = getattr(args, "group_parser", parser)
        sub_parser.print_help()
        return 2
    try:
        return run_handler(handler, args)
    except USER_ERRORS as exc:
        if args.debug:
            raise
        # An error raised inside a Ray task arrives wrapped; its cause holds the message.
        cause = getattr(exc, "cause", None)
        print(format_user_error(cause if isinstance(cause, USER_ERRORS) else exc), file=sys.stderr)
        return 2
    except RunFailure as exc:
        if args.debug:
            raise
        print(f"streamrl: {exc.label}: {exc}", file=sys.stderr)
        return 130 if isinstance(exc, RunInterrupted) else 1


if __name__ == "__main__":
    sys.exit(main())

"""`streamrl make-policy [CONFIG] [overrides]`: build the tiny policy, or a model recipe's checkpoint
from its installed package (``models.recipes``); nothing is downloaded."""


def register(sub) -> None:
    p = sub.add_parser("make-policy", help="build policy.path: the tiny Qwen2 (tokenizer, SFT warm start) or a model recipe (smollm2-*)")
    p.add_argument("config", nargs="?", default=None)
    p.add_argument("overrides", nargs="*")
    p.add_argument("--force", action="store_true", help="rebuild even if policy.path already holds a checkpoint")
    p.set_defaults(handler="streamrl.commands.policy:run")


def run(args) -> int:
    import shutil
    from pathlib import Path

    from streamrl.config import load_cli_config

    cfg = load_cli_config(args.config, args.overrides)
    path = Path(cfg.policy.path)
    if (path / "config.json").is_file() and not args.force:
        print(f"policy already at {path} (use --force to rebuild)")
        return 0
    if args.force and path.exists():
        shutil.rmtree(path)
    import torch

    torch.set_num_threads(cfg.cluster.num_cpus)
    from streamrl.controller.setup import ensure_policy
    ensure_policy(cfg)  # shows its own progress bar
    return 0

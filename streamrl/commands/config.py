"""`streamrl config show [CONFIG] [key.sub=value ...] [--json]`: the fully resolved config."""


def register(sub) -> None:
    p = sub.add_parser("config", help="inspect the resolved config")
    csub = p.add_subparsers(dest="config_command", metavar="SUBCOMMAND")
    p.set_defaults(group_parser=p)
    s = csub.add_parser("show", help="print the fully resolved config (file + overrides + defaults, paths "
                        "absolute) as YAML with each key's description; it loads back as a config file")
    s.add_argument("config", nargs="?", default=None, help="YAML config (default: built-in defaults)")
    s.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4 mode=stream-sync")
    s.add_argument("--json", action="store_true", help="print the config as JSON instead (no comments)")
    s.set_defaults(handler="streamrl.commands.config:show")


def show(args) -> int:
    from streamrl.config import dump_config_annotated, load_config, split_cli_config

    path, overrides = split_cli_config(args.config, args.overrides)
    cfg = load_config(path, overrides)
    if args.json:
        import json

        print(json.dumps(cfg.model_dump(), indent=2))
        return 0
    source = f"config file {str(path)!r}" if path is not None else "built-in defaults"
    given = f" + overrides {' '.join(map(repr, overrides))}" if overrides else ""
    header = [f"streamrl config show: {source}{given}",
              "Resolved: every key, relative paths made absolute. Load it back with `streamrl train <this file>`."]
    print(dump_config_annotated(cfg, header), end="")
    return 0

"""`streamrl task stats [CONFIG] [overrides]`: the length distribution of the policy's responses."""

from streamrl.metrics.report import add_out_argument


def register(sub) -> None:
    p = sub.add_parser("task", help="inspect the task")
    tsub = p.add_subparsers(dest="task_command", metavar="SUBCOMMAND")
    p.set_defaults(group_parser=p)
    s = tsub.add_parser("stats", help="sample the policy at the training temperature and print length statistics")
    s.add_argument("config", nargs="?", default=None)
    s.add_argument("overrides", nargs="*")
    s.add_argument("--prompts", type=int, default=256, help="training prompts to sample (default 256)")
    s.add_argument("--samples", type=int, default=4, help="samples per prompt (default 4)")
    s.add_argument("--records", default=None, metavar="FILE.jsonl",
                   help="also write one {key, text, length, step} record per sample (input of `streamrl rank eval --data samples`)")
    add_out_argument(s)
    s.set_defaults(handler="streamrl.tasks.stats:run")

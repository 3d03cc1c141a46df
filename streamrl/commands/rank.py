"""``streamrl rank eval``: train and evaluate an output-length ranker on a data file.

Only argparse and the report helper are imported here; ``run`` imports the ranker code after
parsing. Protocols and baselines are described in ``streamrl.lab.rank_eval``.
"""

from __future__ import annotations

from streamrl.metrics.report import add_out_argument

DATASETS = ("qwen-math", "skythought", "samples")
RANKER_NAMES = ("learned", "learned-ridge", "history", "blend", "prompt-length", "lm", "reweighted")
DEFAULT_RANKERS = ("learned", "history", "blend", "prompt-length")
PROTOCOLS = ("streaming", "prompts", "samples", "transfer")


def register(sub) -> None:
    group = sub.add_parser("rank", help="output-length ranker (PAPER.md §3.6): train and evaluate")
    rank_sub = group.add_subparsers(dest="rank_command", metavar="COMMAND")
    group.set_defaults(group_parser=group)

    p = rank_sub.add_parser("eval", help="recall of the true longest 20/10/5%% and Spearman, beside the ceiling")
    p.add_argument("--data", choices=DATASETS, required=True,
                   help="qwen-math: 100 prompts x 8 responses; skythought: AIME24 across 11 checkpoints and "
                        "MATH-500 per model; samples: a JSONL of {key, text, length, step} (--file)")
    p.add_argument("--file", default=None, help="records JSONL for --data samples")
    p.add_argument("--data-dir", default=None, help="data folder (default: $STREAMRL_DATA_DIR or ../shared/data)")
    p.add_argument("--ranker", action="append", choices=RANKER_NAMES, default=None,
                   help="ranker to evaluate (repeatable; default: all of " + ", ".join(DEFAULT_RANKERS) + ")")
    p.add_argument("--model", default=None, metavar="DIR",
                   help="base checkpoint of the lm ranker (a policy directory, e.g. a run's checkpoint/policy)")
    p.add_argument("--protocol", action="append", choices=PROTOCOLS, default=None,
                   help="only these protocols (repeatable; default: every one that applies to the data)")
    p.add_argument("--folds", type=int, default=None, help="folds for held-out prompts (5) / samples (2)")
    p.add_argument("--step-field", default="step", metavar="NAME",
                   help="--data samples: the column that orders the records (a run's samples.jsonl: epoch or "
                        "iteration); the streaming protocol's steps")
    p.add_argument("--warmup-steps", type=int, default=1, metavar="N",
                   help="streaming: fit on the first N steps, then score each later step and update with it")
    p.add_argument("--checkpoints", default=None, metavar="DIR",
                   help="--data samples, ranker reweighted: the run's kept policies (out_dir/checkpoints, "
                        "run.keep_checkpoints=true); each streaming step is scored under the newest one at least "
                        "--policy-lag versions older than the policy that generated it")
    p.add_argument("--policy-lag", type=int, default=1, metavar="N",
                   help="versions between the scoring policy and the generating one (1: the live ranker scores "
                        "the next batch ahead)")
    p.add_argument("--beta", type=float, default=None, help="ranker reweighted: temper of the importance weights")
    p.add_argument("--estimator", default=None, choices=("sequence", "per_decision", "hazard", "tree"),
                   help="ranker reweighted: the current policy's probabilities over the tree of remembered "
                        "responses (tree, the default), one importance weight per response (sequence), or per "
                        "token of the survival curve (per_decision, hazard; need the rollout log's logprobs)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="ranker reweighted: the run's sampling temperature (its logged log-probs are under it)")
    p.add_argument("--decay", type=float, default=1.0, help="history/blend weight decay per step, in (0, 1]")
    p.add_argument("--seed", type=int, default=0)
    add_out_argument(p)
    p.set_defaults(handler="streamrl.commands.rank:run_eval")


def run_eval(args) -> int:
    from pathlib import Path

    from streamrl.metrics.report import print_table, write_json
    from streamrl.lab.rank_eval import METRIC_KEYS, run_suite
    from streamrl.tasks.base import default_data_dir

    if args.data == "samples" and not args.file:
        raise SystemExit("streamrl rank eval: --data samples needs --file RECORDS.jsonl")
    if not 0.0 < args.decay <= 1.0:
        raise SystemExit(f"streamrl rank eval: --decay must be in (0, 1], got {args.decay}")
    if args.warmup_steps < 1:
        raise SystemExit(f"streamrl rank eval: --warmup-steps must be >= 1, got {args.warmup_steps}")
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    rankers = tuple(dict.fromkeys(args.ranker)) if args.ranker else DEFAULT_RANKERS
    for name in ("lm", "reweighted"):
        if name in rankers and not args.model:
            raise SystemExit(f"streamrl rank eval: ranker {name!r} runs the policy: give its checkpoint with --model DIR")
    if args.policy_lag < 0:
        raise SystemExit(f"streamrl rank eval: --policy-lag must be >= 0, got {args.policy_lag}")
    reweighted = {"model_path": args.model, "temperature": args.temperature,
                  **({} if args.beta is None else {"beta": args.beta}),
                  **({} if args.estimator is None else {"estimator": args.estimator})}
    kwargs = {"history": {"decay": args.decay}, "blend": {"decay": args.decay}, "lm": {"model_path": args.model},
              "reweighted": reweighted}
    policy_at = None
    if args.checkpoints:
        from streamrl.lab.rank_eval import checkpoint_resolver

        policy_at = checkpoint_resolver(args.checkpoints, args.policy_lag)
    from streamrl.metrics import progress

    with progress.bar(f"rank eval ({args.data}): protocols", total=len(args.protocol) if args.protocol else None):
        results = run_suite(args.data, data_dir, rankers, kwargs, file=args.file, folds=args.folds, seed=args.seed,
                            protocols=args.protocol, step_field=args.step_field, warmup_steps=args.warmup_steps,
                            policy_at=policy_at)
    columns = ["unit", "ranker", *METRIC_KEYS, "n", "batches", "fit_s"]
    all_rows = []
    for title, rows, note in results:
        print_table(f"{title}  [{note}]", rows, columns)
        all_rows.extend({"setting": title, **row} for row in rows)
    print("unit: sample = each response ranked on its own (n responses); group-mean / group-max = the "
          "held-out responses of one prompt in a batch as one GRPO group, truth = their mean / max length "
          "(n groups); see streamrl.lab.rank_eval")
    print("paper (Qwen2.5-7B ranker, Table 4, per sample): recall@20/10/5% = 0.87 / 0.82 / 0.76")
    write_json(args.out, {"data": args.data, "data_dir": str(data_dir), "rankers": list(rankers),
                          "seed": args.seed, "decay": args.decay, "step_field": args.step_field,
                          "warmup_steps": args.warmup_steps, "checkpoints": args.checkpoints,
                          "policy_lag": args.policy_lag, "ranker_kwargs": kwargs, "rows": all_rows})
    return 0

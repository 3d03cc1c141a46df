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
    s.set_defaults(handler="streamrl.commands.task:run")


def run(args) -> int:
    from streamrl.config import load_cli_config
    import numpy as np

    from streamrl.tasks.stats import CRITERIA, check_criteria, length_figures
    from streamrl.tasks.factory import make_task
    from streamrl.controller.setup import ensure_policy
    from streamrl.metrics.report import print_table, write_json

    cfg = load_cli_config(args.config, args.overrides)
    ensure_policy(cfg)
    task = make_task(cfg)
    prompts = task.train_prompts()[: args.prompts]
    from streamrl.metrics import progress

    with progress.bar("task stats: samples", total=len(prompts) * args.samples):
        completions, tokenizer = sample_policy(cfg, prompts, args.samples, threads=cfg.cluster.num_cpus)
    by_id = {p.prompt_id: p for p in prompts}
    from streamrl.controller.setup import user_reward
    from streamrl.tasks.rewards import RewardRunner

    correct, records, seen = [], [], {}
    runner = RewardRunner.for_task(task, cfg.task, reward_fn=user_reward(cfg))  # task.reward when set
    for c in completions:
        pid = c.prompt_id
        correct.append(runner(by_id[pid], tokenizer.decode(list(c.output_ids), skip_special_tokens=True))[0] >= 1.0)
        # One record per sample, numbered per prompt in completion order: `streamrl rank eval
        # --data samples --file` holds out prompts, or samples of seen prompts, from these.
        seen[pid] = seen.get(pid, -1) + 1
        records.append({"key": pid, "text": by_id[pid].text, "length": len(c.output_ids), "step": seen[pid]})
    runner.close()
    if args.records:
        import json
        from pathlib import Path

        Path(args.records).parent.mkdir(parents=True, exist_ok=True)
        Path(args.records).write_text("".join(json.dumps(r) + "\n" for r in records))
        print(f"{len(records)} (prompt, response length) records: {args.records}")
    figures = length_figures([len(c.prompt_ids) for c in completions], [len(c.output_ids) for c in completions])
    figures["sampled_accuracy"] = float(np.mean(correct))
    figures["truncated_frac"] = float(np.mean([c.finish_reason == "length" for c in completions]))
    ok = check_criteria(figures)
    rows = [{"figure": k, "value": v, "criterion": " ".join(map(str, CRITERIA[k])) if k in CRITERIA else "",
             "met": ("yes" if ok[k] else "NO") if k in ok else ""} for k, v in figures.items()]
    print_table(f"{cfg.task.name}: {len(prompts)} prompts x {args.samples} samples, temperature "
                f"{cfg.generation.temperature}, policy {cfg.policy.path}", rows, ["figure", "value", "criterion", "met"])
    write_json(args.out, {"rows": rows, "figures": figures, "criteria_met": ok})
    return 0


def sample_policy(cfg, prompts, samples_per_prompt: int, threads: int = 2):
    """Generate with the configured engine in this process; returns (completions, tokenizer)."""
    from streamrl.sgs.engines.build import engine_kwargs, run_to_completion
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.metrics import progress
    from streamrl.sgs.engines.base import make_engine

    model, tokenizer = load_policy(cfg.policy.path)
    cfg = cfg.model_copy(deep=True)
    cfg.generation.n_samples = samples_per_prompt
    builder = RequestBuilder(tokenizer, cfg)
    requests = builder.build(prompts, iteration=0, tag="stats-")
    engine = make_engine(cfg.generation.engine, model.eval(), **engine_kwargs(cfg, tokenizer, threads, "stats", cfg.run.seed))
    try:
        completions = run_to_completion(engine, requests, on_done=progress.advance)
    finally:
        engine.shutdown()
    return completions, tokenizer

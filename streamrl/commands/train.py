"""`streamrl train CONFIG [key.sub=value ...]`, and its ``--dry-run``."""

from pathlib import Path
from typing import Any

from streamrl.metrics.report import add_out_argument


def register(sub) -> None:
    p = sub.add_parser("train", help="run RL post-training (config file + dotted overrides)")
    p.add_argument("config", nargs="?", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. trainer.lr=3e-4 mode=stream-sync")
    p.add_argument("--plan", default=None, metavar="FILE", help="a placement plan (`streamrl plan ... "
                   "--placement-out FILE`): its sections apply before the command line's overrides")
    p.add_argument("--dry-run", action="store_true", help="validate the config, print the placement plan and "
                   "the inputs a run would read, then exit (no Ray, no torch, no GPU needed)")
    add_out_argument(p)
    p.set_defaults(handler="streamrl.commands.train:run")


def run(args) -> int:
    from streamrl.config import load_cli_config

    from streamrl.config import plan_overrides, split_cli_config

    config, overrides = split_cli_config(args.config, args.overrides)
    if args.plan:
        overrides = plan_overrides(args.plan) + overrides
    cfg = load_cli_config(config, overrides)  # fails before any work on a bad key or value
    if getattr(args, "dry_run", False):
        return _dry_run(cfg, args)
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from streamrl.controller.driver import train
    from streamrl.metrics import progress
    from streamrl.metrics.report import print_table, write_json

    with progress.bar(f"train {cfg.mode}", total=cfg.run.iterations) as bar:
        summary = train(cfg, callbacks=[lambda it, metrics: bar.update(completed=it + 1)])
    before, after = summary["before"], summary["after"]
    rows = []
    for key in ("eval/accuracy", "eval/resp_len/p50", "eval/resp_len/p99", "eval/resp_len/max"):
        rows.append({"metric": key, "before": before.get(key, float("nan")), "after": after.get(key, float("nan")),
                     "delta": after.get(key, float("nan")) - before.get(key, float("nan"))})
    trend = summary.get("reward_trend", {})
    for key in ("first_third_mean", "last_third_mean"):
        if key in trend:
            rows.append({"metric": f"train/reward {key.replace('_', ' ')}", "before": float("nan"), "after": trend[key],
                         "delta": float("nan")})
    print_table(f"held-out evaluation ({cfg.task.num_eval} prompts x {cfg.run.eval_samples} samples), "
                f"{cfg.run.iterations} iterations, mode {cfg.mode}", rows, ["metric", "before", "after", "delta"])
    if "slope_per_iter" in trend:
        print(f"training reward: {trend['first_third_mean']:.3f} over the first third of the iterations, "
              f"{trend['last_third_mean']:.3f} over the last third (least-squares slope {trend['slope_per_iter']:+.4f}/iteration)")
    pipe = summary.get("pipeline") or {}
    if pipe:
        print(f"pipeline ({cfg.mode}): step {pipe['step_s']:.1f}s, generation {pipe['gen_s']:.1f}s and training "
              f"{pipe['train_s']:.1f}s per iteration; efficiency {pipe['efficiency']:.2f} (slower stage / step); "
              f"busy: generation {pipe['gen_busy']:.2f}, trainer {pipe['train_busy']:.2f}")
        print(f"Gantt chart of the stages: {pipe['gantt']}")
    write_json(args.out, {"rows": rows, "summary": summary})
    return 0


def _dry_run(cfg, args) -> int:
    from streamrl.metrics.report import write_json
    from streamrl.placement import format_plan, plan_placement

    report = dry_run(cfg)
    print(format_plan(plan_placement(cfg)))
    for key in ("mode", "engine", "policy", "policy_present", "task_file", "task_file_present",
                "eval_file", "eval_file_present", "reward", "reward_present", "env", "env_present"):
        if key in report:
            print(f"  {key}: {report[key]}")
    write_json(args.out, report)
    missing = [name for name, ok in (("policy.path", report["policy_present"]),
                                     ("task.train_path", report.get("task_file_present", True)),
                                     ("task.eval_path", report.get("eval_file_present", True)),
                                     ("task.reward", report.get("reward_present", True)),
                                     ("task.env/task.tools", report.get("env_present", True))) if not ok]
    if missing:
        print(f"dry run: missing input(s): {', '.join(missing)}")
        return 2
    return 0


def dry_run(cfg) -> dict[str, Any]:
    """What ``streamrl train --dry-run`` reports: the plan and the inputs a real run would read
    (checked for presence here, not loaded: no torch, no Ray, no GPU)."""
    from streamrl.placement import plan_placement

    from streamrl.models.hf import PolicyNotFound, is_tiny_policy_path, resolve_policy_path

    plan = plan_placement(cfg)
    policy: Path | str = Path(cfg.policy.path)
    try:
        policy, present = resolve_policy_path(policy), True
    except PolicyNotFound:  # the tiny policy is built at its cache path on the first real run
        from streamrl.models.recipes import recipe_for

        present = cfg.policy.make_if_missing and (is_tiny_policy_path(policy) or recipe_for(policy) is not None)
    report: dict[str, Any] = {
        "mode": cfg.mode, "engine": cfg.generation.engine, "device": cfg.placement.device,
        "policy": str(policy), "policy_present": bool(present),
        "trainer_ranks": len(plan.trainer), "generation_instances": len(plan.generation),
        "gpus_by_type": plan.gpus_used(), "trainer_strategy": plan.trainer_strategy,
        "plan": [{"role": b.role, "node": b.node, "gpus": list(b.gpus), "resources": b.resources}
                 for b in plan.trainer + plan.generation],
    }
    if cfg.task.name not in ("synthetic", "arithmetic"):  # the generated tasks read no file
        from streamrl.tasks.math import DataError, resolve_data_path

        try:
            path = resolve_data_path(cfg.task.train_path, cfg.task.name)
            report["task_file"], report["task_file_present"] = str(path), path.exists()
        except DataError as exc:
            report["task_file"], report["task_file_present"] = f"unresolved: {exc}", False
        if cfg.task.eval_path:
            path = resolve_data_path(cfg.task.eval_path, cfg.task.name, role="eval")
            report["eval_file"], report["eval_file_present"] = str(path), path.exists()
    from streamrl.config import reward_specs

    if reward_specs(cfg.task):
        from streamrl.tasks.user_reward import RewardSpecError, UserReward

        try:
            UserReward(reward_specs(cfg.task), cfg.task.reward_weights).check()
            report["reward"], report["reward_present"] = reward_specs(cfg.task), True
        except RewardSpecError as exc:
            report["reward"], report["reward_present"] = str(exc), False
    if cfg.task.multi_turn:
        from streamrl.controller.setup import agent_schemas
        from streamrl.tasks.user_reward import RewardSpecError

        try:
            agent_schemas(cfg)
            report["env"], report["env_present"] = [cfg.task.env, *cfg.task.tools], True
        except RewardSpecError as exc:
            report["env"], report["env_present"] = str(exc), False
    return report

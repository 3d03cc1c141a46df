"""Length statistics of the policy's responses on a task (`streamrl task stats`).

The long-tail criteria the benchmarks rely on: p99/p50 of response length >= 5, the longest 10%
of responses hold >= 30% of all response tokens, and Spearman(prompt tokens, response tokens)
<= 0.6 (length is not just a function of prompt length, so ranking it is a real problem).
"""

from __future__ import annotations

import numpy as np

CRITERIA = {"p99_over_p50": (">=", 5.0), "top10_token_share": (">=", 0.30), "spearman_prompt_vs_response": ("<=", 0.6)}


def spearman(x, y) -> float:
    """Rank correlation with average ranks for ties."""
    def ranks(a):
        a = np.asarray(a, dtype=float)
        order = a.argsort(kind="mergesort")
        r = np.empty(len(a))
        r[order] = np.arange(len(a))
        # average ranks of ties
        _, inv, counts = np.unique(a, return_inverse=True, return_counts=True)
        sums = np.bincount(inv, weights=r)
        return sums[inv] / counts[inv]
    rx, ry = ranks(x), ranks(y)
    if rx.std() == 0 or ry.std() == 0:
        return 0.0
    return float(np.corrcoef(rx, ry)[0, 1])


def length_figures(prompt_tokens: list[int], response_tokens: list[int]) -> dict[str, float]:
    r = np.asarray(response_tokens, dtype=float)
    if r.size == 0:
        raise ValueError("no responses to compute statistics on")
    p50, p90, p99 = np.percentile(r, [50, 90, 99])
    top = np.sort(r)[::-1][: max(1, len(r) // 10)]
    return {"responses": int(r.size), "mean": float(r.mean()), "p50": float(p50), "p90": float(p90),
            "p99": float(p99), "max": float(r.max()), "p99_over_p50": float(p99 / max(p50, 1e-9)),
            "top10_token_share": float(top.sum() / r.sum()),
            "spearman_prompt_vs_response": spearman(prompt_tokens, response_tokens)}


def check_criteria(figures: dict[str, float]) -> dict[str, bool]:
    out = {}
    for key, (op, bound) in CRITERIA.items():
        out[key] = figures[key] >= bound if op == ">=" else figures[key] <= bound
    return out


def sample_policy(cfg, prompts, samples_per_prompt: int, threads: int = 2):
    """Generate with the configured engine in this process; returns (completions, tokenizer)."""
    from streamrl.controller.colocated import engine_kwargs, run_to_completion
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.engines.base import make_engine

    model, tokenizer = load_policy(cfg.policy.path)
    cfg = cfg.model_copy(deep=True)
    cfg.generation.n_samples = samples_per_prompt
    builder = RequestBuilder(tokenizer, cfg)
    requests = builder.build(prompts, iteration=0, tag="stats-")
    engine = make_engine(cfg.generation.engine, model.eval(), **engine_kwargs(cfg, tokenizer, threads, "stats", cfg.run.seed))
    try:
        completions = run_to_completion(engine, requests)
    finally:
        engine.shutdown()
    return completions, tokenizer


def run(args) -> int:
    from streamrl.config import load_cli_config
    from streamrl.controller.common import make_task
    from streamrl.controller.driver import ensure_policy
    from streamrl.metrics.report import print_table, write_json

    cfg = load_cli_config(args.config, args.overrides)
    ensure_policy(cfg)
    task = make_task(cfg)
    prompts = task.train_prompts()[: args.prompts]
    completions, tokenizer = sample_policy(cfg, prompts, args.samples, threads=cfg.cluster.num_cpus)
    by_id = {p.prompt_id: p for p in prompts}
    correct, records, seen = [], [], {}
    for c in completions:
        pid = c.request_id.split(":", 1)[1].rsplit("/", 1)[0]
        correct.append(task.reward(by_id[pid], tokenizer.decode(list(c.output_ids), skip_special_tokens=True)))
        # One record per sample, numbered per prompt in completion order: `streamrl rank eval
        # --data samples --file` holds out prompts, or samples of seen prompts, from these.
        seen[pid] = seen.get(pid, -1) + 1
        records.append({"key": pid, "text": by_id[pid].text, "length": len(c.output_ids), "step": seen[pid]})
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

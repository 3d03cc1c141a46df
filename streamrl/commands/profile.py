"""`streamrl profile [CONFIG] [overrides]`: measure decode latency vs batch size and trainer tokens/s."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser(
        "profile", help="measure PTL(batch size) of the engine and the trainer's tokens/s; write a profile JSON",
        description="Measures, on the configured policy (never built here), the engine's per-token decode latency "
                    "at each batch size (generation.threads_per_instance threads) and the trainer's tokens/s "
                    "(trainer.threads threads) on one generated iteration of the workload, prints a table and "
                    "writes the profile that `streamrl simulate modes`, `streamrl plan --profile` and dispatch read.")
    p.add_argument("config", nargs="?", default="configs/bench.yaml")
    p.add_argument("overrides", nargs="*")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32,64", help="comma list (default 1,2,4,8,16,32,64)")
    p.add_argument("--new-tokens", type=int, default=32, help="decode steps per latency run (default 32)")
    p.add_argument("--train-steps", type=int, default=3, help="timed trainer steps after one warm-up (default 3)")
    p.add_argument("--colocated-threads", type=int, default=None,
                   help="also measure at this many threads for colocated mode (default cluster.num_cpus; 0 = skip)")
    p.add_argument("--no-overlap", action="store_true", help="skip timing each stage while the other runs in "
                   "another process (the overlap slowdowns `simulate modes` applies to the stream modes)")
    p.add_argument("--out", metavar="FILE.json", default=None, help="profile path (default profiles/cpu-<model>.json)")
    p.set_defaults(handler="streamrl.commands.profile:run_profile")


def _prepare_desc(train: dict) -> str:
    return (f"{train['prepare_s_per_pass'] * 1e3:.2f} ms per pass + {train['prepare_s_per_padded_token'] * 1e6:.1f} us "
            f"per padded token (passes of {train['micro_batch_tokens']} padded tokens)")


def run_profile(args) -> int:
    """Handler of ``streamrl profile``."""
    import sys

    from streamrl.config import load_config, split_cli_config
    from streamrl.metrics.report import print_table, write_json
    from streamrl.scheduling.latency import latency_from_dict
    from streamrl.lab.profiling.live import DEFAULT_CONFIG, REPEATS, PolicyMissing, default_out, measure_profile

    config, overrides = split_cli_config(args.config, args.overrides, default=DEFAULT_CONFIG)
    cfg = load_config(config, overrides)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        print(f"streamrl profile: --batch-sizes {args.batch_sizes!r} is not a comma list of integers", file=sys.stderr)
        return 2
    try:
        prof = measure_profile(cfg, sizes, args.new_tokens, args.train_steps, args.colocated_threads,
                               repeats=getattr(args, "repeats", REPEATS), overlap=not args.no_overlap)
    except PolicyMissing as exc:
        print(f"streamrl profile: {exc}", file=sys.stderr)
        return 2
    latency_from_dict(prof)  # the file must load back as a LatencyModel
    g = cfg.generation
    prof["workload"] = {"config": config, "overrides": overrides, "algo": cfg.trainer.algo,
                        "prompts_per_iter": g.prompts_per_iter, "n_samples": g.n_samples,
                        "max_new_tokens": g.max_new_tokens, "step_tokens": cfg.trainer.step_tokens}
    table = _ptl_table(prof)
    print_table("streamrl profile: PTL(batch size)", table)
    print(f"{prof['engine']} engine, {prof['model']} ({prof['params'] / 1e6:.2f} M params), {prof['threads']} thread(s), "
          f"random prompts of {round(prof['prompt_len_mean'])} tokens (workload mean {prof['prompt_len_mean']:.1f}), "
          f"latency = ({prof['new_tokens']}-token run - 1-token run) / {prof['new_tokens'] - 1}")
    _print_trainer(prof)
    _print_generation_costs(prof)
    gen = prof["generation"]
    lens = prof["sample_out_lens"]
    print(f"workload iteration ({config}: {g.prompts_per_iter} prompts x {g.n_samples}, cap {g.max_new_tokens}): "
          f"{gen['requests']} requests, mean output {sum(lens) / max(len(lens), 1):.1f} tokens, "
          f"{gen['tokens_per_s']:.0f} output tokens/s end to end")
    out = args.out or default_out(cfg)
    write_json(out, prof)
    print(f"wrote {out}")
    return 0


def _ptl_table(prof: dict) -> list[dict]:
    """The PTL(batch size) table, with the colocated thread count's columns when measured; takes the
    rows out of ``prof`` (the table shows them, the file keeps ``points``)."""
    rows = prof.pop("rows")
    colo = prof.get("colocated")
    table = []
    for i, r in enumerate(rows):
        row = {"batch_size": r["batch_size"], "ms_per_token": r["ms_per_token"], "tokens_per_s": r["tokens_per_s"]}
        if colo:
            c = colo["rows"][i]
            row[f"ms_per_token@{colo['threads']}t"] = c["ms_per_token"]
            row[f"tokens_per_s@{colo['threads']}t"] = c["tokens_per_s"]
        table.append(row)
    if colo:
        colo.pop("rows")
    return table


def _print_trainer(prof: dict) -> None:
    """The trainer's tokens/s (and at the colocated thread count), then its prepare calls against the fit."""
    from streamrl.metrics.report import print_table

    colo = prof.get("colocated")
    tr = prof["train"]
    line = (f"trainer ({tr['algo']}, {prof['trainer_threads']} thread(s)): {prof['train_tokens_per_s']:.0f} tokens/s "
            f"(prepare {tr['prepare_s']:.2f}s + train_step {tr['train_step_s']:.2f}s for {tr['tokens']} tokens, "
            f"{tr['steps']} steps)")
    line += f"; prepare call {_prepare_desc(tr)}, optimizer steps {tr['train_step_tokens_per_s']:.0f} tokens/s"
    if colo:
        ct = colo["train"]
        line += (f"; at {colo['threads']} threads: {colo['train_tokens_per_s']:.0f} tokens/s (prepare call "
                 f"{_prepare_desc(ct)}, steps {ct['train_step_tokens_per_s']:.0f} tokens/s)")
    print(line)
    print_table("prepare calls (Trainer.prepare_groups, median of repeats; last column: the fit)",
                [{**r, "ms_per_sample": r["s"] * 1e3 / r["samples"],
                  "fit_s": r["passes"] * tr["prepare_s_per_pass"] + r["padded_tokens"] * tr["prepare_s_per_padded_token"]}
                 for r in tr["prepare_calls"]])


def _print_generation_costs(prof: dict) -> None:
    """Admission + prefill per request, the overlap slowdowns (when measured) and the context cost of decoding."""
    colo = prof.get("colocated")
    pf = prof["prefill"]
    line = f"admission + prefill per request: {pf['s_per_request'] * 1e3:.2f} ms at {prof['threads']} thread(s)"
    if colo:
        line += f", {colo['prefill']['s_per_request'] * 1e3:.2f} ms at {colo['threads']} threads"
    print(line + f" (one-token runs, {pf['prompt_len']:.0f}-token prompts; median of {prof['repeats']})")
    ov = prof.get("overlap")
    if ov:
        print(f"overlap: the trainer takes {ov['train_slowdown']:.2f}x as long while an instance decodes in another "
              f"process, decoding {ov['decode_slowdown']:.2f}x (median over batch sizes) while a trainer trains")
    kv = prof["kv"]
    line = (f"context cost: {prof['kv_ms_per_token'] * 1e3:.2f} us per running context token per step (batch "
            f"{kv['batch_size']}: {kv['ms_per_token_short']:.2f} ms/step, {kv['ms_per_token_long']:.2f} with "
            f"{kv['extra_context']} more prompt tokens each)")
    if colo:
        line += f", {colo['kv_ms_per_token'] * 1e3:.2f} us at {colo['threads']} threads"
    print(line)

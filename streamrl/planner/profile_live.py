"""``streamrl profile``: measure this machine's generation and training costs for the simulator.

What is measured, all on the configured policy and with real tokens (nothing is modelled):

* **Decode latency PTL(BS)** of one generation instance: the configured engine at
  ``generation.threads_per_instance`` threads, built like the live SGS builds it
  (``controller.colocated.engine_kwargs``) except that EOS is unreachable, so every request runs to
  the requested length. ``sgs.engines.profile.profile_decode_latency`` takes the difference of an
  ``new_tokens``-token run and a 1-token run at each batch size, which removes prefill and
  admission. Prompts are random tokens of the workload's mean prompt length.
* **Trainer tokens/s** at ``trainer.threads`` threads: the engine (EOS reachable) first generates
  one iteration of the real workload (``prompts_per_iter x n_samples`` synthetic-task requests),
  the samples are scored with the task reward, then one untimed warm-up step and ``train_steps``
  timed steps run, each exactly what the live trainer does with a dynamic batch: ``prepare`` per
  group (reference log-probs, critic values, GAE for PPO) and one ``Trainer.train_step``.
  Tokens/s = (prompt + response tokens) / (prepare + step seconds): the unit ``sim.cost.ProfiledTrain``
  charges per sequence.
* **Colocated numbers** (optional, ``colocated_threads``; default ``cluster.num_cpus``): both of the
  above again at the colocated worker's thread count, stored under ``"colocated"``; skipped when
  that equals the disaggregated thread counts or is 0.

The profile file is ``policies.latency``'s format plus extra keys::

    {"engine": "transformers", "model": "tiny-policy", "device": "cpu", "points": [...],
     "train_tokens_per_s": ..., "threads": 1, "trainer_threads": 1, "params": 1234567,
     "prompt_len_mean": 21.3, "new_tokens": 32, "train": {...}, "sample_out_lens": [...],
     "shape": {...}, "colocated": {"threads": 2, "points": [...], "train_tokens_per_s": ...}}

``sample_out_lens`` are the output lengths of the generated iteration (the policy's own length
distribution at profiling time; ``simulate modes`` can replay them).
"""

from __future__ import annotations

import copy
import platform
import re
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from streamrl.config import Config

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONFIG = "configs/bench.yaml"
"""The `bench modes` workload: profile what the bench runs."""


class PolicyMissing(FileNotFoundError):
    """No checkpoint at ``policy.path``: ``streamrl profile`` never builds one."""


def policy_name(path: str) -> str:
    """A file-name-safe name for the policy (its directory name)."""
    name = Path(path).resolve().name or "policy"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def default_out(cfg: Config) -> str:
    return f"profiles/cpu-{policy_name(cfg.policy.path)}.json"


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def measure_decode(cfg: Config, model, tokenizer, threads: int, batch_sizes: Sequence[int], prompt_len: int,
                   new_tokens: int, seed: int) -> list[dict[str, float]]:
    """PTL(BS) rows of one engine instance at ``threads`` threads (EOS unreachable)."""
    from streamrl.controller.colocated import engine_kwargs
    from streamrl.sgs.engines.base import make_engine
    from streamrl.sgs.engines.profile import profile_decode_latency

    kw = {**engine_kwargs(cfg, tokenizer, threads, "profile", seed), "eos_token_id": None}
    engine = make_engine(cfg.generation.engine, copy.deepcopy(model).eval(), **kw)
    try:
        return profile_decode_latency(engine, list(batch_sizes), prompt_len=prompt_len, new_tokens=new_tokens, seed=seed)
    finally:
        engine.shutdown()


def generate_samples(cfg: Config, model, tokenizer, task, threads: int) -> tuple[list, float]:
    """One iteration of the real workload, generated and scored: ``(samples, generation seconds)``."""
    from streamrl.controller.colocated import engine_kwargs, run_to_completion
    from streamrl.controller.common import RequestBuilder
    from streamrl.sgs.engines.base import make_engine
    from streamrl.types import Sample

    prompts = task.train_prompts()[: cfg.generation.prompts_per_iter]
    by_id = {p.prompt_id: p for p in prompts}
    requests = RequestBuilder(tokenizer, cfg).build(prompts, 0, tag="profile-")
    engine = make_engine(cfg.generation.engine, copy.deepcopy(model).eval(),
                         **engine_kwargs(cfg, tokenizer, threads, "profile", cfg.run.seed))
    try:
        t0 = time.perf_counter()
        completions = run_to_completion(engine, requests)
        gen_s = time.perf_counter() - t0
    finally:
        engine.shutdown()
    samples = []
    for c in completions:
        prompt_id, idx = c.request_id.split(":", 1)[1].rsplit("/", 1)
        prompt = by_id[prompt_id]
        text = tokenizer.decode(list(c.output_ids), skip_special_tokens=True)
        samples.append(Sample(prompt=prompt, sample_idx=int(idx), completion=c, response_text=text,
                              reward=float(task.reward(prompt, text))))
    return samples, gen_s


def _sample_group_tokens(group: list) -> int:
    return sum(len(s.completion.prompt_ids) + len(s.completion.output_ids) for s in group)


def measure_train(cfg: Config, samples: list, threads: int, steps: int = 3) -> dict[str, float]:
    """Trainer tokens/s at ``threads`` threads: prepare + ``train_step`` on real samples."""
    from streamrl.controller.common import group_samples
    from streamrl.trainer.trainer import Trainer, dynamic_batches

    tcfg = cfg.model_copy(deep=True)
    tcfg.trainer.threads = threads
    tr = Trainer(tcfg)
    batches = dynamic_batches(group_samples(samples), cfg.trainer.step_tokens, tokens=_sample_group_tokens)

    def one_step(batch: list[list]) -> tuple[float, float, int]:
        tr.begin_iteration()
        t0 = time.perf_counter()
        groups = [tr.prepare(g) for g in batch]
        if cfg.trainer.algo == "grpo":
            tr.set_group_advantages(groups)
        t1 = time.perf_counter()
        tr.train_step([p for g in groups for p in g])
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, sum(p.num_tokens for g in groups for p in g)

    one_step(batches[0])  # warm-up (allocator, first backward)
    prep = step = 0.0
    tokens = 0
    for k in range(max(1, steps)):
        a, b, n = one_step(batches[(k + 1) % len(batches)])
        prep, step, tokens = prep + a, step + b, tokens + n
    return {"train_tokens_per_s": tokens / (prep + step), "prepare_s": prep, "train_step_s": step,
            "tokens": tokens, "steps": max(1, steps), "step_tokens": cfg.trainer.step_tokens,
            "algo": cfg.trainer.algo, "threads": threads}


def measure_profile(cfg: Config, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, new_tokens: int = 32,
                    train_steps: int = 3, colocated_threads: int | None = None,
                    echo: Callable[[str], Any] = print) -> dict[str, Any]:
    """Measure and return the profile dict (see module docstring). Raises ``PolicyMissing``."""
    import torch

    from streamrl.controller.common import make_task
    from streamrl.models.tiny import encode_prompt, load_policy

    if not (Path(cfg.policy.path) / "config.json").is_file():
        raise PolicyMissing(f"no policy checkpoint at {cfg.policy.path!r}; build one first with "
                            f"`streamrl make-policy policy.path={cfg.policy.path}` (streamrl profile does not build it)")
    batch_sizes = sorted({int(b) for b in batch_sizes})
    if not batch_sizes or batch_sizes[0] < 1:
        raise ValueError(f"batch sizes must be positive integers; got {batch_sizes}")
    cap = cfg.generation.max_requests_per_batch
    if batch_sizes[-1] > cap:
        echo(f"profile: dropping batch sizes above generation.max_requests_per_batch={cap} (the engine never runs them)")
        batch_sizes = [b for b in batch_sizes if b <= cap]
    model, tok = load_policy(cfg.policy.path)
    model.eval()
    task = make_task(cfg)
    prompts = task.train_prompts()[:256]
    prompt_len_mean = sum(len(encode_prompt(tok, p.text)) for p in prompts) / len(prompts)
    g_threads, t_threads = cfg.generation.threads_per_instance, cfg.trainer.threads
    c_threads = cfg.cluster.num_cpus if colocated_threads is None else colocated_threads
    prev_threads = torch.get_num_threads()
    try:
        echo(f"profile: decode latency at {g_threads} thread(s), batch sizes {batch_sizes}, {new_tokens} tokens each")
        points = measure_decode(cfg, model, tok, g_threads, batch_sizes, round(prompt_len_mean), new_tokens, cfg.run.seed)
        echo(f"profile: generating one iteration ({cfg.generation.prompts_per_iter} prompts x "
             f"{cfg.generation.n_samples} samples) for the trainer")
        samples, gen_s = generate_samples(cfg, model, tok, task, g_threads)
        echo(f"profile: trainer ({cfg.trainer.algo}) at {t_threads} thread(s), 1 warm-up + {train_steps} timed steps")
        train = measure_train(cfg, samples, t_threads, train_steps)
        colocated = None
        if c_threads and not (c_threads == g_threads and c_threads == t_threads):
            echo(f"profile: colocated numbers at {c_threads} threads")
            c_points = measure_decode(cfg, model, tok, c_threads, batch_sizes, round(prompt_len_mean), new_tokens, cfg.run.seed)
            c_train = measure_train(cfg, samples, c_threads, train_steps)
            colocated = {"threads": c_threads,
                         "points": [{"batch_size": r["batch_size"], "ms_per_token": r["ms_per_token"]} for r in c_points],
                         "train_tokens_per_s": c_train["train_tokens_per_s"], "train": c_train, "rows": c_points}
    finally:
        torch.set_num_threads(prev_threads)
    mc = model.config
    out_lens = [len(s.completion.output_ids) for s in samples]
    prof: dict[str, Any] = {
        "engine": cfg.generation.engine,
        "model": policy_name(cfg.policy.path),
        "device": "cpu",
        "points": [{"batch_size": r["batch_size"], "ms_per_token": r["ms_per_token"]} for r in points],
        "train_tokens_per_s": train["train_tokens_per_s"],
        "threads": g_threads,
        "trainer_threads": t_threads,
        "params": int(sum(p.numel() for p in model.parameters())),
        "prompt_len_mean": prompt_len_mean,
        "new_tokens": new_tokens,
        "cpu": _cpu_name(),
        "policy_path": str(cfg.policy.path),
        "shape": {"layers": mc.num_hidden_layers, "q_heads": mc.num_attention_heads, "kv_heads": mc.num_key_value_heads,
                  "hidden": mc.hidden_size, "intermediate": mc.intermediate_size, "vocab": mc.vocab_size,
                  "tied_embeddings": bool(getattr(mc, "tie_word_embeddings", False))},
        "train": train,
        "generation": {"requests": len(samples), "gen_s": gen_s, "max_new_tokens": cfg.generation.max_new_tokens,
                       "tokens_per_s": sum(out_lens) / gen_s if gen_s > 0 else 0.0},
        "sample_out_lens": out_lens,
        "rows": points,
    }
    if colocated:
        prof["colocated"] = colocated
    return prof


def run_profile(args) -> int:
    """Handler of ``streamrl profile``."""
    import sys

    from streamrl.config import load_config, split_cli_config
    from streamrl.metrics.report import print_table, write_json
    from streamrl.policies.latency import latency_from_dict

    config, overrides = split_cli_config(args.config, args.overrides, default=DEFAULT_CONFIG)
    cfg = load_config(config, overrides)
    try:
        sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    except ValueError:
        print(f"streamrl profile: --batch-sizes {args.batch_sizes!r} is not a comma list of integers", file=sys.stderr)
        return 2
    try:
        prof = measure_profile(cfg, sizes, args.new_tokens, args.train_steps, args.colocated_threads)
    except PolicyMissing as exc:
        print(f"streamrl profile: {exc}", file=sys.stderr)
        return 2
    latency_from_dict(prof)  # the file must load back as a LatencyModel
    g = cfg.generation
    prof["workload"] = {"config": config, "overrides": overrides, "algo": cfg.trainer.algo,
                        "prompts_per_iter": g.prompts_per_iter, "n_samples": g.n_samples,
                        "max_new_tokens": g.max_new_tokens, "step_tokens": cfg.trainer.step_tokens}
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
    tr = prof["train"]
    print_table("streamrl profile: PTL(batch size)", table)
    print(f"{prof['engine']} engine, {prof['model']} ({prof['params'] / 1e6:.2f} M params), {prof['threads']} thread(s), "
          f"random prompts of {round(prof['prompt_len_mean'])} tokens (workload mean {prof['prompt_len_mean']:.1f}), "
          f"latency = ({prof['new_tokens']}-token run - 1-token run) / {prof['new_tokens'] - 1}")
    line = (f"trainer ({tr['algo']}, {prof['trainer_threads']} thread(s)): {prof['train_tokens_per_s']:.0f} tokens/s "
            f"(prepare {tr['prepare_s']:.2f}s + train_step {tr['train_step_s']:.2f}s for {tr['tokens']} tokens, "
            f"{tr['steps']} steps)")
    if colo:
        line += f"; at {colo['threads']} threads: {colo['train_tokens_per_s']:.0f} tokens/s"
    print(line)
    gen = prof["generation"]
    lens = prof["sample_out_lens"]
    print(f"workload iteration ({config}: {g.prompts_per_iter} prompts x {g.n_samples}, cap {g.max_new_tokens}): "
          f"{gen['requests']} requests, mean output {sum(lens) / max(len(lens), 1):.1f} tokens, "
          f"{gen['tokens_per_s']:.0f} output tokens/s end to end")
    out = args.out or default_out(cfg)
    write_json(out, prof)
    print(f"wrote {out}")
    return 0

"""``streamrl profile``: measure this machine's generation and training costs for the simulator.

``measure_profile`` measures, on the configured policy: decode latency PTL(BS) of one generation
instance, admission + prefill per request, the context cost, the trainer's costs, the overlap
slowdowns and the colocated numbers; the result is ``scheduling.latency``'s profile file plus
extra keys, read by ``sim.cost`` (``ProfiledDecode``, ``ProfiledTrain``) and ``simulate modes``.

Invariants: every figure is measured with real tokens (nothing is modelled), each timed piece is
the median of ``REPEATS`` measurements, and the engine is built as the live SGS builds it but
with EOS unreachable. ``profiling.measure`` has the measurements; ``measure_profile`` lists them
and the file's keys.
"""

from __future__ import annotations

import platform
import re
from pathlib import Path
from typing import Any, Callable, Sequence

from streamrl.config import Config
from streamrl.lab.profiling.measure import (REPEATS, fit_prefill, generate_samples, measure_colocated, measure_decode,
                                            measure_train)

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


def measure_profile(cfg: Config, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, new_tokens: int = 32,
                    train_steps: int = 3, colocated_threads: int | None = None,
                    echo: Callable[[str], Any] = print, repeats: int = REPEATS, overlap: bool = True) -> dict[str, Any]:
    """Measure and return the profile dict. Raises ``PolicyMissing``.

    What is measured, all on the configured policy and with real tokens:

    * **Decode latency PTL(BS)** of one generation instance, built as the live SGS builds it
      (``sgs.engines.build.engine_kwargs``) but with EOS unreachable, so every request runs
      to the requested length: ``profiling.decode.profile_decode_latency`` takes the difference
      of a ``new_tokens``-token run and a 1-token run at each batch size, which removes prefill.
    * **Admission + prefill per request**: ``fit_prefill`` fits ``one_token_s(b) - PTL(b) = c +
      d * b`` and stores ``d`` under ``"prefill"``; the simulator charges it per admitted request.
    * **Context cost** ``kv_ms_per_token`` (``profiling.decode.context_cost``: PTL again at batch
      16 with 200 more prompt tokens each), as ``bench scheduling`` measures it.
    * **Trainer costs** at ``trainer.threads`` threads on one generated iteration of the real
      workload (``measure_train``): optimizer steps on dynamic batches of ``trainer.step_tokens``
      (``train_step_tokens_per_s``), and ``Trainer.prepare_groups`` on calls of 1, 2, 4, ...
      live units (a sample for PPO, a group for GRPO), fitted as ``prepare_s_per_pass * passes +
      prepare_s_per_padded_token * padded tokens`` (``fit_prepare_calls``);
      ``sim.cost.ProfiledTrain`` charges calls in that form. Also the combined
      ``train_tokens_per_s``.
    * **Overlap slowdowns** (``profiling.overlap``): the trainer timed while an instance decodes
      in another process, and decode latency while a trainer trains, against the solo numbers,
      under ``"overlap"`` (``train_slowdown``, ``decode_slowdown``).
    * **Colocated numbers** (``colocated_threads``, default ``cluster.num_cpus``; 0 skips): the
      above again in the colocated worker's process layout (``measure_colocated``: an engine
      alive beside the trainer changes libgomp's spinning), under ``"colocated"``.

    Every timed piece is the median of ``repeats`` measurements; profile on a quiet machine
    (other processes only add time, far more to a 2-thread OpenMP team than to one thread).

    The profile is ``scheduling.latency``'s format plus extra keys::

        {"engine": "transformers", "model": "tiny-policy", "device": "cpu", "points": [...],
         "train_tokens_per_s": ..., "threads": 1, "trainer_threads": 1, "params": 1234567,
         "prompt_len_mean": 21.3, "new_tokens": 32, "train": {...}, "sample_out_lens": [...],
         "shape": {...}, "prefill": {"s_per_request": ..., "tokens_per_s": ..., "rows": [...]},
         "kv_ms_per_token": ..., "kv": {...},
         "colocated": {"threads": 2, "points": [...], "train_tokens_per_s": ..., "train": {...},
                       "prefill": {...}, "kv_ms_per_token": ..., "kv": {...}}}

    ``sample_out_lens`` are the output lengths of the generated iteration (``simulate modes``
    can replay them)."""
    from streamrl.tasks.factory import make_task
    from streamrl.models.tiny import encode_prompt, load_policy

    batch_sizes = _checked_batch_sizes(cfg, batch_sizes, echo)
    model, tok = load_policy(cfg.policy.path)
    model.eval()
    task = make_task(cfg)
    prompts = task.train_prompts()[:256]
    prompt_len_mean = sum(len(encode_prompt(tok, p.text)) for p in prompts) / len(prompts)
    measured = _measure(cfg, model, tok, task, batch_sizes, prompt_len_mean, new_tokens, train_steps,
                        colocated_threads, echo, repeats, overlap)
    return _profile_dict(cfg, model, prompt_len_mean, new_tokens, repeats, measured)


def _checked_batch_sizes(cfg: Config, batch_sizes: Sequence[int], echo: Callable[[str], Any]) -> list[int]:
    """Raises ``PolicyMissing`` without a checkpoint at ``policy.path``; returns the batch sizes
    sorted and distinct, those above ``generation.max_requests_per_batch`` dropped."""
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
    return batch_sizes


def _measure(cfg: Config, model, tok, task, batch_sizes: list[int], prompt_len_mean: float, new_tokens: int,
             train_steps: int, colocated_threads: int | None, echo: Callable[[str], Any], repeats: int,
             overlap: bool) -> dict[str, Any]:
    """The timed stages in turn (decode latency, one generated iteration, the trainer, the overlap
    slowdowns, the colocated numbers), torch's thread count restored after; returns their results
    by name (``overlapped`` and ``colocated`` None when skipped)."""
    import torch

    g_threads, t_threads = cfg.generation.threads_per_instance, cfg.trainer.threads
    c_threads = cfg.cluster.num_cpus if colocated_threads is None else colocated_threads
    prev_threads = torch.get_num_threads()
    try:
        echo(f"profile: decode latency at {g_threads} thread(s), batch sizes {batch_sizes}, {new_tokens} tokens each "
             f"(median of {repeats})")
        points, one, kv = measure_decode(cfg, model, tok, g_threads, batch_sizes, round(prompt_len_mean), new_tokens,
                                         cfg.run.seed, repeats)
        echo(f"profile: generating one iteration ({cfg.generation.prompts_per_iter} prompts x "
             f"{cfg.generation.n_samples} samples) for the trainer")
        samples, gen_s = generate_samples(cfg, model, tok, task, g_threads)
        echo(f"profile: trainer ({cfg.trainer.algo}) at {t_threads} thread(s), 1 warm-up + {train_steps} timed steps")
        train = measure_train(cfg, samples, t_threads, train_steps, repeats)
        overlapped = None
        if overlap:
            from streamrl.lab.profiling.overlap import measure_overlap

            echo("profile: each stage again while the other runs in another process (overlap slowdowns)")
            overlapped = measure_overlap(cfg, model, tok, samples, points, train, batch_sizes, round(prompt_len_mean),
                                         new_tokens, repeats)
        colocated = None
        if c_threads and not (c_threads == g_threads and c_threads == t_threads):
            echo(f"profile: colocated numbers at {c_threads} threads (engine and trainer alive in one process)")
            colocated = measure_colocated(cfg, model, tok, samples, c_threads, batch_sizes, round(prompt_len_mean),
                                          new_tokens, train_steps, repeats)
    finally:
        torch.set_num_threads(prev_threads)
    return {"points": points, "one": one, "kv": kv, "samples": samples, "gen_s": gen_s, "train": train,
            "overlapped": overlapped, "colocated": colocated}


def _profile_dict(cfg: Config, model, prompt_len_mean: float, new_tokens: int, repeats: int,
                  measured: dict[str, Any]) -> dict[str, Any]:
    """The profile file's dict (keys: ``measure_profile``) from ``_measure``'s results."""
    points, one, kv, train = measured["points"], measured["one"], measured["kv"], measured["train"]
    samples, gen_s = measured["samples"], measured["gen_s"]
    mc = model.config
    out_lens = [len(s.completion.output_ids) for s in samples]
    prof: dict[str, Any] = {
        "engine": cfg.generation.engine,
        "model": policy_name(cfg.policy.path),
        "device": "cpu",
        "points": [{"batch_size": r["batch_size"], "ms_per_token": r["ms_per_token"]} for r in points],
        "train_tokens_per_s": train["train_tokens_per_s"],
        "kv_ms_per_token": kv["kv_ms_per_token"],
        "kv": kv,
        "threads": cfg.generation.threads_per_instance,
        "trainer_threads": cfg.trainer.threads,
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
        "prefill": {**fit_prefill(one, points), "rows": one},
        "repeats": repeats,
        "rows": points,
    }
    if measured["colocated"]:
        prof["colocated"] = measured["colocated"]
    if measured["overlapped"]:
        prof["overlap"] = measured["overlapped"]
    return prof

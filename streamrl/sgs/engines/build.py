"""Building and driving an engine from a run config: what instances, the colocated worker, the
benches and the profiler share.

``engine_kwargs`` maps the ``generation`` section to a backend's constructor arguments;
``run_to_completion`` adds a batch of requests and collects every completion (one blocking call,
for callers that do not stream).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from streamrl.types import Completion, GenRequest

if TYPE_CHECKING:
    from streamrl.config import Config


def engine_kwargs(cfg: "Config", tokenizer, threads: int, instance: str, seed: int) -> dict:
    from streamrl.models.hf import stop_token_ids

    g = cfg.generation
    policy_dir = getattr(tokenizer, "name_or_path", None) or cfg.policy.path
    kw = dict(temperature=g.temperature, top_p=g.top_p, eos_token_id=stop_token_ids(tokenizer, policy_dir),
              pad_token_id=tokenizer.pad_token_id, max_batch_tokens=g.max_batch_tokens,
              max_requests_per_batch=g.max_requests_per_batch, num_blocks=g.num_blocks, page_size=g.page_size,
              num_threads=threads, seed=seed, instance=instance)
    if g.engine == "vllm":  # the placement plan's TP degree (its bundle holds that many GPUs)
        kw["tensor_parallel_size"] = cfg.placement.gen_gpus_per_instance if cfg.placement.device == "cuda" else 1
        kw["prefix_cache"] = g.prefix_cache is not False  # None = on: version-salted (vllm_engine.py)
    if g.engine == "transformers":
        kw["attention"] = g.cb_attention
        kw["prefix_cache"] = cfg.task.multi_turn if g.prefix_cache is None else g.prefix_cache
    return kw


def run_to_completion(engine, requests: list[GenRequest], on_done=None) -> list[Completion]:
    """Add every request and collect every completion (in completion order); ``on_done(n)`` is
    called as completions arrive (a progress bar)."""
    for r in requests:
        engine.add_request(r)
    done: list[Completion] = []
    while len(done) < len(requests):
        new = engine.get_completions(timeout=1.0)
        done.extend(new)
        if on_done is not None and new:
            on_done(len(new))
    return done

"""The run's prompts, filtered once before Ray starts: a prompt that cannot fit the engine's
context is dropped here, counted and logged, never in the middle of a batch."""

from __future__ import annotations

import json
import logging

from streamrl.config import Config
from streamrl.controller.common import RequestBuilder

log = logging.getLogger(__name__)

def usable_prompts(cfg: Config, task, builder: RequestBuilder):
    """The task's train and eval prompts that fit: at most ``task.max_prompt_tokens`` tokens as
    the engine will see them (chat template included), and prompt + ``generation.max_new_tokens``
    within the policy's context. The rest are dropped here, once, counted and logged (never in
    the middle of a batch, so no batch is ever empty); if no training prompt fits, the run stops
    naming the limit. Returns ``(train, eval, metrics)``."""
    from streamrl.tasks.math import DataError

    limit, why = cfg.task.max_prompt_tokens, f"task.max_prompt_tokens={cfg.task.max_prompt_tokens}"
    context = _policy_context(cfg.policy.path)
    if context is not None and context - cfg.generation.max_new_tokens < limit:
        limit = context - cfg.generation.max_new_tokens
        why = (f"the policy's context {context} - generation.max_new_tokens={cfg.generation.max_new_tokens}")
    if limit < 1:
        raise DataError(f"generation.max_new_tokens={cfg.generation.max_new_tokens} leaves no room for a prompt in "
                        f"the policy's context ({context} tokens)")

    def fits(prompts, role: str):
        kept, over = [], []
        for p in prompts:
            (kept if len(builder.encode(p.text)) <= limit else over).append(p)
        for p in over[:5]:
            log.warning("%s prompt %s has %d tokens > %d (%s): not used", role, p.prompt_id,
                        len(builder.encode(p.text)), limit, why)
        if len(over) > 5:
            log.warning("... and %d more %s prompts over %d tokens", len(over) - 5, role, limit)
        return kept, len(over)

    train, n_train = fits(task.train_prompts(), "train")
    evals, n_eval = fits(task.eval_prompts(), "eval")
    if not train:
        raise DataError(f"every training prompt ({n_train}) is longer than {limit} tokens ({why})")
    if not evals:
        raise DataError(f"every held-out prompt ({n_eval}) is longer than {limit} tokens ({why})")
    report = task.load_report()
    metrics = {"data/train_prompts": float(len(train)), "data/eval_prompts": float(len(evals)),
               "data/oversized": float(n_train + n_eval), "data/prompt_token_limit": float(limit),
               **(report.metrics() if report is not None else {})}
    return train, evals, metrics


def _policy_context(path) -> int | None:
    """``max_position_embeddings`` of the policy's config.json, if it says."""
    from streamrl.models.hf import resolve_policy_path

    try:
        return int(json.loads((resolve_policy_path(path) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError, TypeError):
        return None

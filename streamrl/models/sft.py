"""Supervised warm start of the tiny policy on the synthetic task (``streamrl make-policy``).

A randomly initialised model cannot earn any reward, so RL would have no signal. We train on
freshly drawn worked solutions (teacher forcing, loss on response tokens only) and stop as soon
as *sampled* accuracy (temperature 1, the way RL samples) reaches ``policy.sft_target_accuracy``:
clearly above zero, clearly below the ceiling, so RL has something to improve.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from streamrl.metrics import progress as progress_bar
from streamrl.config import PolicyConfig
from streamrl.models.tiny import build_model, build_tokenizer, encode_prompt, save_policy
from streamrl.tasks.synthetic import ALPHABET, TASK_VERSION, SyntheticSpec, make_problem

log = logging.getLogger(__name__)


POLICY_MARKER = "streamrl_policy.json"
"""Written beside a policy that ``make_policy`` built: the task version it was warm-started on."""


def policy_is_stale(path: str | Path) -> bool:
    """True when ``path`` holds a policy streamrl built for another synthetic task version."""
    marker = Path(path) / POLICY_MARKER
    if not marker.is_file():
        return False
    return json.loads(marker.read_text()).get("synthetic_task_version") != TASK_VERSION


@dataclass
class SFTResult:
    steps: int
    seconds: float
    tokens_per_s: float
    sampled_accuracy: float
    loss: float


def _encode_problems(tokenizer, problems) -> list[tuple[list[int], int]]:
    out = []
    for prompt, solution, _ in problems:
        p = encode_prompt(tokenizer, prompt)
        out.append((p + tokenizer.encode(solution, add_special_tokens=False) + [tokenizer.eos_token_id], len(p)))
    return out


def _bucketed_batches(tokenizer, rng: random.Random, size: int, spec: SyntheticSpec, buckets: int = 8):
    """Endless batches of similar-length sequences: draw ``buckets * size`` problems, sort by
    length, cut into ``buckets`` batches, shuffle them. Cuts padding (lengths are long-tailed)."""
    while True:
        encoded = sorted(_encode_problems(tokenizer, [make_problem(rng, spec) for _ in range(size * buckets)]),
                         key=lambda e: len(e[0]))
        chunks = [encoded[i: i + size] for i in range(0, len(encoded), size)]
        rng.shuffle(chunks)
        for chunk in chunks:
            yield _collate(tokenizer, chunk)


def _collate(tokenizer, encoded: list[tuple[list[int], int]]):
    seqs = [e[0] for e in encoded]
    starts = [e[1] for e in encoded]
    size = len(seqs)
    width = max(map(len, seqs))
    ids = torch.full((size, width), tokenizer.pad_token_id, dtype=torch.long)
    labels = torch.full((size, width), -100, dtype=torch.long)
    for i, (seq, start) in enumerate(zip(seqs, starts)):
        ids[i, : len(seq)] = torch.tensor(seq)
        labels[i, start: len(seq)] = torch.tensor(seq[start:])
    return ids, labels, (ids != tokenizer.pad_token_id).long()


@torch.no_grad()
def sample(model, tokenizer, prompts: list[str], temperature: float = 1.0, max_new_tokens: int = 220,
           batch_size: int = 64) -> list[str]:
    """Sample one response per prompt with ``model.generate`` (left padding). Used by SFT's
    accuracy probe only; RL generation goes through the engine."""
    model.eval()
    outs: list[str] = []
    for i in range(0, len(prompts), batch_size):
        chunk = [encode_prompt(tokenizer, p) for p in prompts[i: i + batch_size]]
        width = max(map(len, chunk))
        ids = torch.full((len(chunk), width), tokenizer.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, seq in enumerate(chunk):
            ids[j, width - len(seq):] = torch.tensor(seq)
            mask[j, width - len(seq):] = 1
        gen = model.generate(
            input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
            max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )
        outs.extend(tokenizer.decode(g[width:], skip_special_tokens=True) for g in gen)
    model.train()
    return outs


def sampled_accuracy(model, tokenizer, problems: list[tuple[str, str, str]], max_new_tokens: int = 220,
                     by_subtask: dict | None = None) -> float:
    """Fraction of problems solved by one temperature-1 sample; fills ``by_subtask`` if given."""
    responses = sample(model, tokenizer, [p for p, _, _ in problems], max_new_tokens=max_new_tokens)
    hits = [r.strip() == sol for r, (_, sol, _) in zip(responses, problems)]
    if by_subtask is not None:
        for kind in sorted({p[0] for p, _, _ in problems}):
            mine = [h for h, (p, _, _) in zip(hits, problems) if p[0] == kind]
            by_subtask[kind] = sum(mine) / len(mine)
    return sum(hits) / len(problems)


def make_policy(cfg: PolicyConfig, out_dir: str, seed: int = 0, spec: SyntheticSpec = SyntheticSpec(),
                probe_every: int = 100, probe_size: int = 128, progress=None) -> SFTResult:
    """Build tokenizer and model, warm-start by SFT, save to ``out_dir``; returns what happened."""
    torch.manual_seed(seed)
    rng = random.Random(seed + 17)
    tokenizer = build_tokenizer([ALPHABET])
    model = build_model(cfg, len(tokenizer), tokenizer, seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.sft_lr, weight_decay=0.01, betas=(0.9, 0.98))
    # Linear warm-up, then cosine decay to 5% over the step budget: the low-lr tail is what
    # turns a policy that is roughly right into one whose temperature-1 chains come out exact.
    warmup, total = 50, max(cfg.sft_steps, 51)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    probe_rng = random.Random(seed + 99)
    probe = [make_problem(probe_rng, spec) for _ in range(probe_size)]  # probe_size=0: no probe
    t0, tokens, acc, loss_val, step = time.time(), 0, 0.0, float("nan"), 0
    model.train()
    batches = _bucketed_batches(tokenizer, rng, cfg.sft_batch_size, spec)
    for step in range(1, cfg.sft_steps + 1):
        ids, labels, mask = next(batches)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens += int(mask.sum())
        loss_val = float(out.loss.detach())
        progress_bar.update(step, cfg.sft_steps)
        if probe and (step % probe_every == 0 or step == cfg.sft_steps):
            per: dict[str, float] = {}
            acc = sampled_accuracy(model, tokenizer, probe, by_subtask=per)
            detail = " ".join(f"{k}={v:.2f}" for k, v in per.items())
            msg = f"sft step {step} loss {loss_val:.4f} sampled_acc {acc:.3f} ({detail}) ({time.time() - t0:.0f}s)"
            log.info(msg)
            if progress is not None:
                progress(step, cfg.sft_steps, msg)
            if acc >= cfg.sft_target_accuracy:
                break
    seconds = time.time() - t0
    save_policy(model, tokenizer, out_dir)
    result = SFTResult(steps=step, seconds=seconds, tokens_per_s=tokens / seconds, sampled_accuracy=acc, loss=loss_val)
    (Path(out_dir) / POLICY_MARKER).write_text(json.dumps(
        {"synthetic_task_version": TASK_VERSION, "seed": seed, "sft": asdict(result)}, indent=2))
    return result

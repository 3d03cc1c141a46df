"""One trainer configuration on a real checkpoint: peak resident memory and training tokens/s.

Runs ``Trainer.train_step`` (GRPO, no KL) on batches shaped like the SmolLM2 recipe's (4 groups x
8 samples, 37-token prompts, 10-64-token responses; token ids drawn at random, rewards 0/1) in
this process, and prints one JSON line. Run each configuration in its own process: the peak
(VmHWM) is per process. Works on older checkouts too (no streamrl import beyond the trainer).

    python scripts/trainer_memory.py --policy .cache/smollm2-135m-instruct --threads 1 \
        --micro-batch-tokens 1024 --activation-checkpointing
"""

from __future__ import annotations

import argparse
import json
import random
import time


def peak_gb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 2**20


def published_bytes(tr) -> int:
    if getattr(tr, "lora", False):
        from streamrl.models.lora import adapter_tensors

        state = adapter_tensors(tr.model)
    else:
        state = tr.model.state_dict()
    seen, total = set(), 0
    for t in state.values():  # tied tensors travel once
        key = (t.untyped_storage().data_ptr(), t.storage_offset())
        if key not in seen:
            seen.add(key)
            total += t.numel() * 4
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--micro-batch-tokens", type=int, default=4096)
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (0 = every weight)")
    ap.add_argument("--lr", type=float, default=1e-5)
    a = ap.parse_args()
    from streamrl.config import load_config
    from streamrl.trainer.trainer import Prepared, Trainer, set_group_advantages

    overrides = [f"policy.path={a.policy}", f"trainer.threads={a.threads}",
                 f"trainer.micro_batch_tokens={a.micro_batch_tokens}", f"trainer.lr={a.lr}"]
    if a.activation_checkpointing:
        overrides.append("trainer.activation_checkpointing=true")
    if a.lora_rank:
        overrides.append(f"trainer.lora.rank={a.lora_rank}")
    tr = Trainer(load_config(None, overrides))
    vocab = tr.model.config.vocab_size
    rng = random.Random(0)
    rows = []
    for step in range(a.steps):
        groups = []
        for g in range(4):
            group = []
            for _ in range(8):
                prompt = [rng.randrange(vocab) for _ in range(37)]
                resp = [rng.randrange(vocab) for _ in range(rng.randint(10, 64))]
                group.append(Prepared(input_ids=prompt + resp, resp_start=37, old_logprobs=[-1.0] * len(resp),
                                      reward=float(rng.random() < 0.3), version=0, prompt_id=f"{step}-{g}"))
            groups.append(group)
        set_group_advantages(groups)
        items = [p for g in groups for p in g]
        t0 = time.time()
        tr.train_step(items)
        dt = time.time() - t0
        rows.append({"tokens": sum(p.num_tokens for p in items), "seconds": dt})
    print(json.dumps({"policy": a.policy, "threads": a.threads, "micro_batch_tokens": a.micro_batch_tokens,
                      "activation_checkpointing": a.activation_checkpointing, "lora_rank": a.lora_rank,
                      "trainable": sum(p.numel() for p in tr.model.parameters() if p.requires_grad),
                      # what one weight update publishes, in float32 (the whole state, or the adapter)
                      "update_bytes": published_bytes(tr),
                      "parameters": sum(p.numel() for p in tr.model.parameters()),
                      "tokens_per_s": [round(r["tokens"] / r["seconds"], 1) for r in rows],
                      "peak_rss_gb": round(peak_gb(), 2)}))


if __name__ == "__main__":
    main()

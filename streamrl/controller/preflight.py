"""Will the model fit this machine? A memory estimate made before Ray starts.

The parameter count comes from the checkpoint's safetensors headers (no weights are read). Per
process, in float32 on CPU: the trainer holds weights, gradients and Adam's two moments (16 bytes
per parameter), a reference (4) when KL is on, a critic (16) for PPO, and the published copy
and its object-store copy (2 x the wire dtype); with LoRA, the frozen weights (4) and the critic.
A generation instance holds its weights, a received copy and the engine's working set (12).
Each process gets 1 GB beside that (activations, the KV cache, the interpreter). On a local
cluster a run whose estimate exceeds the memory the machine has available is refused in one
line, naming the figures; a cluster given by address is not checked (its nodes are elsewhere).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from streamrl.errors import UserError

GB = 2**30
DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


class ModelTooLarge(UserError, MemoryError):
    """The run's memory estimate exceeds what the machine has available."""


def checkpoint_parameters(path: str | Path) -> int | None:
    """Parameters stored in ``path``'s ``*.safetensors`` files (from their headers), or None."""
    total, files = 0, sorted(Path(path).glob("*.safetensors"))
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                count = 1
                for d in meta["shape"]:
                    count *= d
                total += count
    return total if files else None


def estimate_gb(cfg, params: int) -> dict[str, float]:
    """Estimated peak resident memory (GB) per process kind, and ``total`` on this machine."""
    t, wire = cfg.trainer, 2 if cfg.wire_dtype() == "bfloat16" else 4
    if t.lora.rank > 0:  # frozen weights; the adapters, their state and the published copies are small
        trainer = params * (4 + (16 if t.algo == "ppo" else 0)) / GB + 1
    else:
        trainer = params * (16 + (4 if t.kl_coef > 0 else 0) + (16 if t.algo == "ppo" else 0) + 2 * wire) / GB + 1
    instance = params * 12 / GB + 1
    instances = 1 if cfg.mode == "colocated" else cfg.generation.num_instances
    total = trainer + instances * instance + 0.5  # the driver
    return {"trainer": trainer, "instance": instance, "instances": instances, "total": total}


def available_gb() -> float | None:
    """``MemAvailable`` from /proc/meminfo, in GB (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024 / GB
    except OSError:
        pass
    return None


def check_fits(cfg, policy_path: str | Path) -> dict[str, float] | None:
    """Raise ``ModelTooLarge`` when a local run cannot fit; returns the estimate (None if unknown)."""
    params = checkpoint_parameters(policy_path)
    if params is None or cfg.cluster.address:
        return None
    est = estimate_gb(cfg, params)
    have = available_gb()
    if have is not None and est["total"] > have:
        raise ModelTooLarge(
            f"policy.path={str(policy_path)!r} has {params / 1e6:.1f}M parameters: the trainer needs about "
            f"{est['trainer']:.1f} GB and each of {est['instances']} generation instance(s) {est['instance']:.1f} GB, "
            f"{est['total']:.1f} GB in all, more than the {have:.1f} GB this machine has available")
    return est

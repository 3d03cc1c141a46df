"""Build an FSDP2-sharded policy without any rank holding the full model: meta-device init, then
each rank reads its own shard of every parameter from the checkpoint's safetensors files.

    config.json --from_config on "meta"--> shapes only --shard_policy--> DTensor params (meta)
    --to_empty--> this rank's shards, uninitialised --per tensor: mmap read, keep the local chunk-->
    loaded shards; non-persistent buffers (rotary inv_freq) rebuilt from the config

Invariants: one full tensor at most is materialised at a time (``LoadInfo`` records the largest);
every parameter comes from the file or the load fails naming it; tied weights are one parameter
and load once. ``supported`` says when the path applies (a safetensors checkpoint, no adapters,
no buffers it cannot rebuild); otherwise the caller loads the whole model and shards it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass
class LoadInfo:
    """How a rank got its weights (read by tests and logged once)."""

    meta_init: bool
    largest_full_tensor_bytes: int = 0
    """The largest tensor this rank held whole while loading (the meta path holds one at a time)."""
    model_bytes: int = 0
    """All parameters in fp32: what a rank would hold loading the full model first."""


def safetensors_files(policy_dir: Path) -> dict[str, Path]:
    """Tensor name -> the file that holds it (``model.safetensors`` or an index's shards); ``{}``
    when the checkpoint has neither."""
    index = policy_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: policy_dir / f for name, f in weight_map.items()}
    single = policy_dir / "model.safetensors"
    if not single.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(single), framework="pt") as f:
        return {name: single for name in f.keys()}


def _rebuild_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers are in no checkpoint: rebuild the rotary tables from the config (a
    fresh copy of the module on CPU) and refuse any other kind."""
    for name, module in model.named_modules():
        own = {b for b, _ in module.named_buffers(recurse=False)}
        if not own:
            continue
        if not (hasattr(module, "inv_freq") and hasattr(module, "config")):
            raise NotImplementedError(f"meta init cannot rebuild the buffers {sorted(own)} of {name or 'the model'}")
        fresh = type(module)(module.config)
        for b in own:
            setattr(module, b, getattr(fresh, b).to(device))


def supported(policy_dir: Path, lora: bool) -> bool:
    """The meta path applies: a safetensors checkpoint and no adapters (peft's adapter init would
    have to be replayed shard by shard to match the single-process trainer's)."""
    return not lora and bool(safetensors_files(policy_dir))


def build_sharded_policy(policy_dir: str | Path, shard, device: torch.device,
                         activation_checkpointing: bool = False) -> tuple[torch.nn.Module, LoadInfo]:
    """The policy of ``policy_dir`` in fp32 with FSDP2 applied by ``shard(model)``, this rank's
    shards loaded from the checkpoint. Call on every rank (the sharding is a collective setup)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor, distribute_tensor
    from transformers import AutoConfig, AutoModelForCausalLM

    policy_dir = Path(policy_dir)
    files = safetensors_files(policy_dir)
    config = AutoConfig.from_pretrained(policy_dir)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if activation_checkpointing:
        enable_activation_checkpointing(model)
    shard(model)
    model.to_empty(device=device)
    info = LoadInfo(meta_init=True, model_bytes=sum(p.numel() * 4 for p in model.parameters()))
    handles: dict[Path, object] = {}  # one open (memory-mapped) reader per file
    try:
        with torch.no_grad():
            for name, param in model.named_parameters():  # tied weights appear once
                if name not in files:
                    raise KeyError(f"{policy_dir}: parameter {name} is in no safetensors file of the checkpoint")
                if files[name] not in handles:
                    handles[files[name]] = safe_open(str(files[name]), framework="pt")
                full = handles[files[name]].get_tensor(name).to(torch.float32)
                info.largest_full_tensor_bytes = max(info.largest_full_tensor_bytes, full.numel() * full.element_size())
                if isinstance(param, DTensor):  # keep this rank's chunk (FSDP2 shards dim 0 as torch.chunk does)
                    local = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                    param.to_local().copy_(local)
                else:
                    param.copy_(full)
                del full
    finally:
        handles.clear()
    _rebuild_buffers(model, device)
    return model, info


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder block's activations in the backward pass (non-reentrant)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:  # the older name
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

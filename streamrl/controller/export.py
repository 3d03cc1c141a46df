"""The trained policy as a standard Hugging Face checkpoint (model, tokenizer with its chat
template, generation config) in ``policy.save_dtype``; with LoRA, the adapter in peft's format
and, on request, the base model with the adapter merged in."""

from __future__ import annotations

import shutil
from pathlib import Path

from streamrl.config import Config

def save_dtype(cfg: Config) -> str:
    """``policy.save_dtype``, with auto = bfloat16 on GPU, float32 on CPU."""
    if cfg.policy.save_dtype != "auto":
        return cfg.policy.save_dtype
    return "bfloat16" if cfg.placement.device == "cuda" else "float32"


def export_policy(src: Path, dst: Path, dtype: str) -> Path:
    """The trained policy as a standard checkpoint at ``dst`` (model, tokenizer with its chat
    template, generation config) in ``dtype``; written beside, then moved into place."""
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    if dtype == "float32" or (src / "adapter_config.json").is_file():  # fp32 master weights, or an adapter
        shutil.copytree(src, tmp)
    else:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(src, dtype=getattr(torch, dtype))
        model.save_pretrained(tmp)
        for f in src.iterdir():
            if not (tmp / f.name).exists() and f.is_file():
                shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst


def export_merged(base: Path, adapter: Path, dst: Path, dtype: str) -> Path:
    """``base`` with the peft adapter at ``adapter`` merged in, saved at ``dst`` in ``dtype`` (with
    the adapter directory's tokenizer files); written beside, then moved into place."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    tmp = dst.with_name(dst.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    merged = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    merged.to(getattr(torch, dtype)).save_pretrained(tmp)
    for f in list(base.iterdir()) + list(adapter.iterdir()):  # tokenizer, generation config, chat template
        if f.is_file() and not f.name.startswith("adapter_") and f.suffix != ".safetensors" and not (tmp / f.name).exists():
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(dst, ignore_errors=True)
    tmp.replace(dst)
    return dst

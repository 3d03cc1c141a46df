"""The trained policy as a standard Hugging Face checkpoint (model, tokenizer with its chat
template, generation config) in ``policy.save_dtype``."""

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
    if dtype == "float32":  # the trainer saves fp32 master weights
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

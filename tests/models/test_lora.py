"""LoRA (``trainer.lora``): the modules that get adapters, what travels, the merge an instance
does, and the trainer's adapters, reference and checkpoint. Delivery through Ray and whole runs
are in tests/controller/test_lora_runs.py."""

from __future__ import annotations

import pytest
import torch

from streamrl.config import ConfigError, LoraConfig, load_config
from streamrl.models import lora


def _tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).eval()


def _random_adapter(peft_model, seed: int) -> None:
    """Fill every lora_B (zero at init) with noise: an adapter as training would leave it."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)


def test_default_targets_are_every_linear_layer_but_the_head_and_unknown_names_are_refused():
    model = _tiny_model()
    assert lora.target_modules(LoraConfig(rank=4), model) == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj",
                                                             "up_proj", "v_proj"]
    assert lora.target_modules(LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]), model) == ["q_proj", "v_proj"]
    with pytest.raises(ConfigError, match=r"\['qkv_proj'\]: not linear modules of this model; it has down_proj, "
                                          r"gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        lora.target_modules(LoraConfig(rank=4, target_modules=["q_proj", "qkv_proj"]), model)


def test_lora_is_refused_only_with_the_reweighted_ranker():
    with pytest.raises(ConfigError, match="ranker.name='reweighted': that ranker scores with full policy weights"):
        load_config(None, ["trainer.lora.rank=8", "ranker.name=reweighted"])
    assert load_config(None, ["trainer.lora.rank=8"]).trainer.lora.rank == 8
    assert load_config(None, ["trainer.lora.rank=8", "trainer.backend=fsdp", "mode=stream-async"]).trainer.lora.rank == 8
    assert load_config(None, ["trainer.lora.rank=8", "generation.engine=vllm"]).trainer.lora.rank == 8


def test_the_published_adapter_holds_only_adapter_tensors_named_after_the_base_modules():
    model = lora.wrap(_tiny_model(), LoraConfig(rank=4, target_modules=["q_proj", "v_proj"]))
    adapter = lora.adapter_tensors(model)
    assert sorted(adapter) == sorted(f"model.layers.{i}.self_attn.{m}.lora_{ab}" for i in range(2)
                                     for m in ("q_proj", "v_proj") for ab in "AB")
    assert adapter["model.layers.0.self_attn.q_proj.lora_A"].shape == (4, 32)
    assert adapter["model.layers.0.self_attn.v_proj.lora_B"].shape == (16, 4)  # 2 kv heads x 8


def test_an_adapter_at_rank_16_is_under_5_percent_of_smollm2_135m():
    """SmolLM2-135M's architecture (built on the meta device: no weights): every linear layer of
    the blocks adapted at rank 16 holds 3.6 % of the parameters a full update sends."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
    with torch.device("meta"):
        model = lora.wrap(LlamaForCausalLM(cfg), LoraConfig(rank=16))
    full = sum(p.numel() for n, p in model.named_parameters() if "lora_" not in n)
    adapter = sum(t.numel() for t in lora.adapter_tensors(model).values())
    assert full == 134_515_008 and adapter == 30 * 16 * (2 * (576 + 576) + 2 * (576 + 192) + 3 * (576 + 1536))
    assert adapter / full < 0.05


def test_merging_successive_adapters_gives_the_peft_forward_of_each_and_the_base_back():
    trained = lora.wrap(_tiny_model(), LoraConfig(rank=4, alpha=8))
    plain = _tiny_model()
    base_logits = plain(torch.arange(12)[None]).logits.detach()
    merger = lora.AdapterMerger(plain, lora.scale(LoraConfig(rank=4, alpha=8)))
    x = torch.randint(0, 64, (2, 10))
    with torch.no_grad():
        base_x = plain(x).logits
    for seed in (1, 2):  # the second install replaces the first: nothing of it stays
        _random_adapter(trained, seed)
        adapter = lora.adapter_tensors(trained)
        merger.merge(adapter, merger.check(adapter))
        with torch.no_grad():
            torch.testing.assert_close(plain(x).logits, trained(x).logits, atol=1e-5, rtol=0)
            assert (plain(x).logits - base_x).abs().max() > 1e-2
    with torch.no_grad():
        for p in trained.parameters():
            if p.requires_grad:
                p.zero_()
        zero = lora.adapter_tensors(trained)
        merger.merge(zero, merger.check(zero))
        torch.testing.assert_close(plain(torch.arange(12)[None]).logits, base_logits, atol=1e-5, rtol=0)


def test_the_merger_refuses_what_is_not_an_adapter_of_this_model():
    merger = lora.AdapterMerger(_tiny_model(), 2.0)
    a, b = torch.zeros(4, 32), torch.zeros(32, 4)
    with pytest.raises(KeyError, match="is not an adapter tensor"):
        merger.check({"model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32)})
    with pytest.raises(KeyError, match="'model.layers.9.self_attn.q_proj' is not a linear module"):
        merger.check({"model.layers.9.self_attn.q_proj.lora_A": a, "model.layers.9.self_attn.q_proj.lora_B": b})
    with pytest.raises(KeyError, match="needs both lora_A and lora_B"):
        merger.check({"model.layers.0.self_attn.q_proj.lora_A": a})
    with pytest.raises(ValueError, match="do not fit its weight"):
        merger.check({"model.layers.0.self_attn.k_proj.lora_A": a, "model.layers.0.self_attn.k_proj.lora_B": b})


@pytest.mark.slow
def test_the_lora_trainer_trains_only_adapters_and_its_reference_is_the_base_model(tiny_policy_dir, tmp_path):
    from streamrl.models.logprobs import model_logprobs
    from streamrl.models.tiny import load_policy
    from streamrl.trainer.trainer import Trainer

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "trainer.lora.rank=4", "trainer.kl_coef=0.1"])
    tr = Trainer(cfg)
    assert tr.ref is None  # no second copy of the weights
    trainable = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in tr.opt.param_groups) == len(trainable)
    _random_adapter(tr.model, 0)
    base, _ = load_policy(tiny_policy_dir)
    ids, attn = torch.randint(3, 40, (2, 9)), torch.ones(2, 9, dtype=torch.long)
    with torch.no_grad():
        expected = model_logprobs(base, ids, attn, tr.temperature)[0]
        adapted = model_logprobs(tr.model, ids, attn, tr.temperature)[0]
    torch.testing.assert_close(tr._ref_logprobs(ids, attn), expected, atol=1e-5, rtol=0)
    assert (adapted - expected).abs().max() > 1e-3  # the adapter is on outside the reference
    # the checkpoint: the adapters and their optimizer state, not the base weights
    for p in tr.model.parameters():  # one optimizer step, so that Adam has state to save
        if p.requires_grad:
            p.grad = torch.ones_like(p)
    tr.opt.step()
    tr.save_checkpoint(tmp_path / "ckpt", {"iteration": 0})
    state = torch.load(tmp_path / "ckpt" / "trainer.pt", weights_only=False)
    assert set(state["model"]) == {n for n in tr.model.state_dict() if "lora_" in n}
    assert (tmp_path / "ckpt" / "policy" / "adapter_model.safetensors").is_file()
    other = Trainer(cfg)
    other.load_checkpoint(tmp_path / "ckpt")
    for (n, p), (_, q) in zip(tr.model.named_parameters(), other.model.named_parameters()):
        assert torch.equal(p, q), n
    assert str(other.opt.state_dict()["state"]) == str(tr.opt.state_dict()["state"])

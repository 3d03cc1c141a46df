"""LoRA through the real path: the adapter the trainer publishes reaches every instance (its
log-probs become the trainer's, not the base model's: verl #7495's failure would show here),
only adapter bytes travel, and whole runs train, export a peft adapter and resume."""

from __future__ import annotations

import json

import pytest
import torch

from streamrl.config import load_config

pytestmark = pytest.mark.slow  # Ray, engines, trainers


def _cfg(policy_dir, *overrides):
    return load_config(None, [f"policy.path={policy_dir}", "trainer.lora.rank=4", "generation.max_new_tokens=24",
                              "generation.n_samples=2", "task.num_eval=4", *overrides])


def test_an_instance_generates_with_the_adapter_the_trainer_published(ray_session, tiny_policy_dir):
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.logprobs import model_logprobs
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.tasks.synthetic import SyntheticTask
    from streamrl.trainer.trainer import Trainer
    from tests.models.test_lora import _random_adapter

    cfg = _cfg(tiny_policy_dir)
    trainer = Trainer(cfg)
    _random_adapter(trainer.model, 0)
    trainer.version = 1
    handle = trainer.publish()
    sgs = StreamGenerationService(cfg)
    sgs.add_instances(2)
    try:
        fetched = sgs.update(handle, 1)
        prompts = SyntheticTask(num_train=3, num_eval=1, seed=1).train_prompts()
        requests = RequestBuilder(trainer.tokenizer, cfg).build(prompts, iteration=0)
        done = list(sgs.generate(requests))
    finally:
        sgs.shutdown()
    adapter_bytes = sum(t.numel() * 4 for t in trainer.policy_state().values())
    full_bytes = sum(t.numel() * 4 for n, t in trainer.model.state_dict().items() if "lora_" not in n)
    assert len(fetched) == 2 and all(f["bytes"] <= adapter_bytes + 4096 for f in fetched)  # the adapter alone
    assert adapter_bytes < 0.2 * full_bytes
    assert {c.version_start for c in done} == {1} and len(done) == len(requests)
    base, _ = load_policy(tiny_policy_dir)
    trainer.model.eval()
    for c in done:
        ids = torch.tensor([list(c.prompt_ids) + list(c.output_ids)])
        attn = torch.ones_like(ids)
        with torch.no_grad():
            ours = model_logprobs(trainer.model, ids, attn, cfg.generation.temperature)[0][0, len(c.prompt_ids) - 1:]
            theirs = model_logprobs(base, ids, attn, cfg.generation.temperature)[0][0, len(c.prompt_ids) - 1:]
        # the engine's sampled log-probs are the trainer's under the same adapter, not the base model's
        torch.testing.assert_close(torch.tensor(c.logprobs), ours, atol=2e-3, rtol=0)
        assert (torch.tensor(c.logprobs) - theirs).abs().max() > 0.05


@pytest.mark.parametrize("mode", ["stream-async", "colocated"])
def test_a_lora_run_trains_exports_a_peft_adapter_and_resumes(ray_session, tiny_policy_dir, tmp_path, mode):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from streamrl.controller.driver import train

    def parity(response, answer, prompt, metadata):  # a verifiable reward that varies within a group
        return float(len(response) % 2)

    out = tmp_path / "run"
    args = [f"run.out_dir={out}", f"mode={mode}", "generation.prompts_per_iter=4", "run.eval_samples=1",
            "logging.backends=[jsonl]", "trainer.lr=5e-3", "cluster.num_cpus=2",
            "weights.wire_dtype=bfloat16", "weights.delta=true"]  # bf16 and deltas on the adapter too
    first = train(_cfg(tiny_policy_dir, *args, "run.iterations=2"), echo=lambda *a: None, reward_fn=parity)
    assert first["trained_samples_unique"] == 2 * 4 * 2
    saved = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    assert saved["model"] and all("lora_" in k for k in saved["model"])  # the adapters alone
    summary = train(_cfg(tiny_policy_dir, *args, "run.iterations=3", "run.resume=true",
                         "trainer.lora.export_merged=true"), echo=lambda *a: None, reward_fn=parity)
    assert summary["trained_samples_unique"] == 3 * 4 * 2  # the resumed run trained iteration 2 only
    resumed = torch.load(out / "checkpoint" / "trainer.pt", weights_only=False)
    moved = [k for k in saved["model"] if not torch.equal(saved["model"][k], resumed["model"][k])]
    assert moved and resumed["opt"]["state"][0]["step"] > saved["opt"]["state"][0]["step"]  # Adam continued
    base = AutoModelForCausalLM.from_pretrained(tiny_policy_dir)
    adapted = PeftModel.from_pretrained(base, out / "policy")  # the exported adapter, in peft's format
    merged = AutoModelForCausalLM.from_pretrained(out / "policy-merged")
    x = torch.arange(3, 15)[None]
    with torch.no_grad():
        torch.testing.assert_close(merged(x).logits, adapted(x).logits, atol=1e-4, rtol=0)
    if mode != "colocated":
        fetches = [e for e in json.loads((out / "timeline.json").read_text())["events"] if e["what"] == "weight_fetch"]
        adapter = sum(v.numel() * 2 for v in resumed["model"].values())  # bf16
        assert fetches and all(e["meta"]["bytes"] <= adapter + 4096 for e in fetches)
        assert {e["meta"]["kind"] for e in fetches} >= {"full", "delta"}  # after the first copy, deltas

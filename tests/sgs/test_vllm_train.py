"""A short stream-async RL run whose generation instances are vLLM engines (``make test-vllm``).

Skipped where vLLM is not importable (the main venv); ``STREAMRL_REQUIRE_VLLM=1`` turns the skip
into a failure. The run uses the real pieces end to end: Ray actors, two vLLM instances, the
trainer actor, weights pushed through the object store and installed by vLLM's
``reload_weights`` while the next iteration generates.
"""

from __future__ import annotations

import importlib.util
import json
import os

import pytest

from streamrl.config import PolicyConfig, load_config
from tests.helpers import (AllOnFirst, assert_moved_running_and_joined, assert_the_stalled_instance_was_replaced,
                           generate_stalling_the_busiest)

pytestmark = pytest.mark.slow  # Ray, vLLM engines and the trainer actor

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("STREAMRL_REQUIRE_VLLM") == "1":
        raise RuntimeError("STREAMRL_REQUIRE_VLLM=1 but vllm is not importable in this environment")
    pytest.skip("vllm is not installed in this environment (`make test-vllm` builds .venv-vllm)",
                allow_module_level=True)


@pytest.fixture(scope="module")
def vllm_policy_dir(tmp_path_factory):
    """The tiny policy, briefly SFT-trained, with a head size vLLM's CPU attention supports (32)."""
    import torch

    from streamrl.models.sft import make_policy

    torch.set_num_threads(2)
    path = tmp_path_factory.mktemp("policy") / "tiny-vllm"
    cfg = PolicyConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=128,
                       sft_steps=60, sft_batch_size=16, sft_lr=3e-3)
    make_policy(cfg, str(path), seed=0, probe_size=0)
    return str(path)


@pytest.fixture
def ray_three_cpus():
    import ray

    ray.init(num_cpus=3, include_dashboard=False, log_to_driver=False,
             runtime_env={"env_vars": {"HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}})
    yield ray
    ray.shutdown()


@pytest.mark.parametrize("variant", ["full", "lora", "multi-turn"])
def test_stream_async_run_with_two_vllm_instances(ray_three_cpus, vllm_policy_dir, tmp_path, variant):
    """With LoRA the trainer publishes the adapter alone and each vLLM instance merges it; multi-turn
    trajectories (the scripted chain env) run their turns on vLLM instances."""
    from streamrl.controller.driver import train

    iterations = 4
    out = tmp_path / "run"
    cfg = load_config(None, [
        f"policy.path={vllm_policy_dir}", f"run.out_dir={out}", "mode=stream-async", "generation.engine=vllm",
        "generation.num_instances=2", "generation.max_new_tokens=32", "generation.n_samples=4",
        "generation.prompts_per_iter=6", "task.num_eval=8", "run.eval_samples=1", "cluster.num_cpus=3",
        "logging.backends=[console,jsonl]", f"run.iterations={iterations}", "trainer.lr=1e-3",
        *(["trainer.lora.rank=4", "trainer.lr=1e-2"] if variant == "lora" else []),
        *(["task.env=streamrl.agent.scripted:ChainEnv", "logging.samples=true"] if variant == "multi-turn" else [])])
    lines: list[str] = []
    summary = train(cfg, echo=lines.append)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    per_iter = [r for r in records if "reward/mean" in r]
    assert len(per_iter) == iterations and all(r["batch/samples"] == 6 * 4 for r in per_iter)
    assert all(r["gen/tokens_per_s"] > 0 for r in per_iter)
    # One-step asynchrony: iteration i generates with weights >= W_{i-1}, never staler.
    assert all(r["staleness/max"] <= 1 for r in per_iter)
    assert [r["gen/version"] for r in per_iter][-1] >= iterations - 2
    # Both vLLM instances generated, and generation used trained weights (versions > 0).
    gens = [e for e in json.loads((out / "timeline.json").read_text())["events"] if e["what"] == "generate"]
    assert {e["who"] for e in gens} == {"gen-0", "gen-1"}
    assert max(e["version"] for e in gens) >= iterations - 2
    assert "eval/accuracy" in summary["after"] and len(summary["rewards"]) == iterations
    if variant == "multi-turn":
        rows = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
        assert len(rows) == iterations * 6 * 4 and any(r["turns"] > 1 for r in rows)
        assert all(r["loss_mask"].count(0) == r["env_tokens"] and len(set(r["turn_instances"])) == 1 for r in rows)
    assert (out / "checkpoint" / "policy" / ("adapter_config.json" if variant == "lora" else "config.json")).is_file()
    fetched = [e["meta"]["bytes"] for e in json.loads((out / "timeline.json").read_text())["events"]
               if e["what"] == "weight_fetch"]
    adapter = 2 * 4 * 4 * (64 + 64 + 64 + 32 + 64 + 32 + 64 + 64 + 3 * (64 + 128))  # 2 layers x rank 4 x fp32
    assert fetched and all((b <= adapter + 4096) == (variant == "lora") for b in fetched)  # the adapter alone, or everything


def test_rebalancing_moves_running_vllm_requests_with_their_prefix(ray_three_cpus, vllm_policy_dir):
    """Runtime rebalancing on vLLM instances: the SGS builds them with ``track_progress`` (it may
    rebalance), so running requests can be stopped and resumed on the other instance from their
    prefix. Four requests fill gen-0's batch while gen-1 idles; each comes back exactly once, whole.
    EOS is off (``eos_token_id=None``) although the policy's ``generation_config.json`` names one,
    which vLLM must not add to the stop set: every request runs to its 160 tokens."""
    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.tasks.synthetic import SyntheticTask

    cfg = load_config(None, [
        f"policy.path={vllm_policy_dir}", "generation.engine=vllm", "generation.rebalance=true",
        "generation.rebalance_threshold=0.1", "generation.max_requests_per_batch=4", "generation.max_new_tokens=160",
        "generation.n_samples=1", "generation.rebalance_interval_s=0.05", "ranker.name=none", "cluster.num_cpus=3"])
    _, tok = load_policy(vllm_policy_dir)
    requests = RequestBuilder(tok, cfg).build(SyntheticTask(num_train=4, num_eval=1, seed=2).train_prompts(), 0, tag="mv")
    sgs = StreamGenerationService(cfg, engine_overrides={"eos_token_id": None})
    sgs.add_instances(2)
    sgs.dispatch = AllOnFirst()
    done, wanted = [], {r.request_id for r in requests}
    try:
        sgs.submit(requests)
        while wanted:
            for c in sgs.poll():
                wanted.discard(c.request_id)
                done.append(c)
    finally:
        sgs.shutdown()
    assert_moved_running_and_joined(sgs, requests, done, 160)


def test_vllm_requests_longer_than_the_heartbeat_finish_and_a_stalled_engine_is_replaced(
        ray_three_cpus, vllm_policy_dir, tmp_path):
    """Liveness on vLLM without rebalancing (the SGS builds no ``track_progress`` engine): with a
    0.5 s heartbeat timeout (shorter than a poll may block), requests of 3,000 tokens each run
    many timeouts long and all come back whole, with no instance taken for hung. Then one engine
    stops stepping while its actor keeps answering: that instance is found, replaced, and its
    requests finish elsewhere."""
    import shutil
    from dataclasses import replace

    from streamrl.controller.common import RequestBuilder
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.tasks.synthetic import SyntheticTask

    # the same weights with room for long requests (rotary positions are computed, not stored)
    policy = tmp_path / "long-context"
    shutil.copytree(vllm_policy_dir, policy)
    config = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    timeout, new_tokens = 0.5, 3000
    cfg = load_config(None, [
        f"policy.path={policy}", "generation.engine=vllm", f"generation.heartbeat_timeout_s={timeout}",
        f"generation.max_new_tokens={new_tokens}", "generation.n_samples=1", "generation.max_requests_per_batch=4",
        "ranker.name=none", "cluster.num_cpus=3"])
    _, tok = load_policy(str(policy))
    builder = RequestBuilder(tok, cfg)
    sgs = StreamGenerationService(cfg, engine_overrides={"eos_token_id": None})  # every request runs to its length
    sgs.add_instances(2)
    try:
        long = builder.build(SyntheticTask(num_train=4, num_eval=1, seed=3).train_prompts(), 0, tag="long")
        done = list(sgs.generate(long))
        assert sorted(c.request_id for c in done) == sorted(r.request_id for r in long)
        assert all(len(c.output_ids) == new_tokens for c in done)
        assert all(c.t_end - c.t_start > 4 * timeout for c in done)  # each request outlived the timeout
        assert sgs.counters["sgs/faults"] == 0 and sgs.faults == []

        # two waves of a batch of 4 per instance: the stall lands on the busiest one's second wave
        short = [replace(r, max_new_tokens=200) for r in
                 builder.build(SyntheticTask(num_train=16, num_eval=1, seed=4).train_prompts(), 1, tag="short")]
        seen, stalled, alive = generate_stalling_the_busiest(sgs, short)
    finally:
        sgs.shutdown()
    assert_the_stalled_instance_was_replaced(sgs, short, seen, stalled, alive)

"""FSDP2 on CPU: two gloo ranks, Ray actors in one placement group, take one optimizer step that
matches a single-process step.

This is the GPU trainer's code path (``streamrl.trainer.fsdp``) with the backend swapped: the
parameters are really sharded (DTensors), the forward all-gathers, the backward reduce-scatters,
ranks with fewer micro-batches join with zero-loss micro-steps.
"""

from __future__ import annotations

import random

import pytest
import torch

from streamrl.config import load_config
from streamrl.trainer.fsdp import shard_items
from streamrl.trainer.trainer import Prepared, Trainer


def _cfg(policy_dir):
    return load_config(None, [f"policy.path={policy_dir}", "trainer.lr=1e-2", "trainer.micro_batch_tokens=64",
                              "trainer.grad_clip=1000", "logging.backends=[console,jsonl]"])


def _items(trainer: Trainer, n: int, seed: int = 0) -> list[Prepared]:
    """Random responses with on-policy old log-probs (ratio 1: every token gets a gradient)."""
    from streamrl.models.logprobs import token_logprobs

    rng = random.Random(seed)
    vocab = trainer.model.config.vocab_size
    items = []
    for i in range(n):
        prompt = [rng.randrange(4, vocab) for _ in range(rng.randint(2, 6))]
        resp = [rng.randrange(4, vocab) for _ in range(rng.randint(1, 20))]
        ids = torch.tensor([prompt + resp])
        with torch.no_grad():
            lp = token_logprobs(trainer.model(ids).logits[:, :-1], ids[:, 1:], trainer.temperature)
        old = lp[0, len(prompt) - 1:].tolist()
        adv = rng.uniform(-1, 1)
        items.append(Prepared(input_ids=prompt + resp, resp_start=len(prompt), old_logprobs=old, reward=adv,
                              version=0, prompt_id=f"p{i}", advantages=[adv] * len(resp)))
    return items


def test_shard_items_balances_tokens_and_covers_every_item_once():
    items = [Prepared(input_ids=[0] * n, resp_start=1, old_logprobs=[0.0] * (n - 1), reward=0.0, version=0,
                      prompt_id=str(i)) for i, n in enumerate([9, 2, 7, 3, 3, 5, 1])]
    shards = shard_items(items, 3)
    assert sorted(p.prompt_id for s in shards for p in s) == sorted(p.prompt_id for p in items)
    loads = [sum(p.num_tokens for p in s) for s in shards]
    assert max(loads) - min(loads) <= 1 and loads == [10, 10, 10]
    assert all([p.prompt_id for p in s] == sorted((p.prompt_id for p in s), key=int) for s in shards)  # order kept
    assert shard_items(items[:1], 2)[1] == []  # fewer items than ranks: a rank may get none
    with pytest.raises(ValueError, match="world_size=0"):
        shard_items(items, 0)


@pytest.mark.slow
def test_fsdp2_ranks_as_ray_workers_in_a_placement_group_step_like_one_process(ray_session, tiny_policy_dir):
    """The ranks build the model on the meta device and read only their shards (no rank holds
    the whole model), recompute activations in backward, and still step like one process."""
    from streamrl.trainer.fsdp import FSDPTrainerGroup

    cfg = _cfg(tiny_policy_dir)
    torch.set_num_threads(1)
    single = Trainer(cfg)
    items = _items(single, 5)  # odd count, uneven lengths: the ranks get different micro-batch counts
    before = {k: v.clone() for k, v in single.model.state_dict().items()}
    ref_metrics = single.train_step(items)
    ckpt = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"activation_checkpointing": True})})
    group = FSDPTrainerGroup(ckpt, tiny_policy_dir, bundles=[{"CPU": 1}, {"CPU": 1}], strategy="STRICT_PACK")
    try:
        assert group.world_size == 2 and group.backend == "gloo"
        for info in group._all("loaded"):
            assert info["meta_init"] and info["activation_checkpointing"], info
            assert 0 < info["largest_full_tensor_bytes"] < info["model_bytes"] / 4, info  # one tensor at a time
        metrics = group.train_step(items)
        assert sum(metrics["train/rank_samples"]) == 5 and min(metrics["train/rank_samples"]) >= 1
        assert metrics["train/grad_norm"] == pytest.approx(ref_metrics["train/grad_norm"], rel=1e-4)
        state = group.policy_state()
        assert group.finish_iteration() == 1
    finally:
        group.shutdown()
    moved = 0
    for name, ref in single.model.state_dict().items():
        torch.testing.assert_close(state[name], ref, atol=2e-5, rtol=1e-4, msg=lambda m: f"{name}: {m}")
        moved += int(not torch.equal(ref, before[name]))
    assert moved > len(before) // 2  # the step really changed the weights, on both paths alike

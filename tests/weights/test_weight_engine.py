"""The weight engine: lossless deltas, the broadcast tree, full copies for receivers that are behind."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from streamrl.weights.delta import DeltaError, apply_delta, make_delta
from streamrl.weights.engine import to_wire
from streamrl.weights.flat import flatten
from streamrl.weights.tree import Location, crossings, levels, plan_tree


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 64))


def _adam_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(32, 64, generator=g)
    loss = (model(x) - x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def _versions(lr: float, steps: int, wire: str) -> list[np.ndarray]:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    out = [flatten(to_wire(model.state_dict(), wire), 0).buffer]
    for k in range(steps):
        _adam_step(model, opt, k)
        out.append(flatten(to_wire(model.state_dict(), wire), k + 1).buffer)
    return out


@pytest.mark.parametrize("wire", ["bfloat16", "float32"])
@pytest.mark.parametrize("lr", [1e-6, 1e-2])
def test_a_delta_applied_to_version_v_is_bit_identical_to_the_full_copy_of_v_plus_1(wire, lr):
    bufs = _versions(lr, 3, wire)
    for v in range(3):
        d = make_delta(bufs[v], bufs[v + 1], v, v + 1, bucket_bytes=4096)
        rebuilt = apply_delta(bufs[v], d, v)
        assert rebuilt.tobytes() == bufs[v + 1].tobytes()
        assert d.nbytes <= bufs[v + 1].nbytes  # never more than a full copy (raw buckets cap it)


def test_a_small_learning_rate_in_bf16_sends_a_small_fraction_and_fp32_half_or_more():
    """fp32: every low 16-bit word moves at any learning rate; bf16 rounds most steps away."""
    small = _versions(1e-6, 1, "bfloat16")
    d = make_delta(small[0], small[1], 0, 1, bucket_bytes=4096)
    assert d.changed_fraction < 0.2
    assert {b.kind for b in d.buckets} & {"idx", "mask"}
    full = _versions(1e-6, 1, "float32")
    assert make_delta(full[0], full[1], 0, 1, bucket_bytes=4096).changed_fraction > 0.5


def test_each_bucket_encoding_round_trips():
    rng = np.random.default_rng(0)
    old = rng.integers(0, 256, 3 * 4096, dtype=np.uint8)
    new = old.copy()
    new[10] ^= 1  # bucket 0: one word changed -> idx
    w = new[4096:8192].view("<u2")
    w[::5] += 1  # bucket 1: a fifth of the words -> mask
    new[8192:] = rng.integers(0, 256, 4096, dtype=np.uint8)  # bucket 2: everything -> raw
    d = make_delta(old, new, 7, 8, bucket_bytes=4096)
    assert [b.kind for b in d.buckets] == ["idx", "mask", "raw"]
    assert apply_delta(old, d, 7).tobytes() == new.tobytes()


def test_a_delta_refuses_the_wrong_base_and_a_corrupted_base():
    old = np.arange(4096, dtype=np.uint8)
    new = old.copy()
    new[100] = 0
    d = make_delta(old, new, 3, 4)
    with pytest.raises(DeltaError, match="applied to version 2"):
        apply_delta(old, d, 2)
    corrupt = old.copy()
    corrupt[2000] ^= 0xFF  # a receiver whose copy differs from what the sender diffed against
    with pytest.raises(DeltaError, match="checksum"):
        apply_delta(corrupt, d, 3)


def _sites() -> tuple[Location, dict[str, Location]]:
    source = Location("A0", "A")
    receivers = {"gen-0": Location("B0", "B"), "gen-1": Location("B1", "B"), "gen-2": Location("B2", "B"),
                 "gen-3": Location("B3", "B"), "gen-4": Location("B1", "B"), "gen-5": Location("C0", "C"),
                 "gen-6": Location("A1", "A"), "gen-7": Location("A0", "A")}
    return source, receivers


def test_the_tree_sends_one_copy_per_remote_site_and_naive_one_per_remote_receiver():
    source, receivers = _sites()
    tree = plan_tree(source, receivers, "tree")
    assert crossings(tree, source, receivers) == {"A->B": 1, "A->C": 1}
    naive = plan_tree(source, receivers, "naive")
    assert crossings(naive, source, receivers) == {"A->B": 5, "A->C": 1}
    assert set(tree) == set(receivers) == set(naive)


def test_inside_a_site_no_sender_feeds_more_than_fanout_nodes_and_a_node_shares_one_copy():
    source, receivers = _sites()
    for fanout in (1, 2, 3):
        parents = plan_tree(source, receivers, "tree", fanout=fanout)
        cross_node: dict[str | None, int] = {}
        for name, parent in parents.items():
            src = source if parent is None else receivers[parent]
            if src.node != receivers[name].node:
                cross_node[parent] = cross_node.get(parent, 0) + 1
        publisher = cross_node.pop(None)
        assert publisher <= fanout + 2  # its own site's roots, and one relay per remote site (B, C)
        assert max(cross_node.values()) <= fanout
        assert parents["gen-4"] == "gen-1"  # same node B1: the leader's copy
        assert parents["gen-7"] is None  # on the publisher's node
        order = [n for level in levels(parents) for n in level]
        for name, parent in parents.items():
            if parent is not None:
                assert order.index(parent) < order.index(name)


def test_an_unknown_method_fails_naming_it():
    with pytest.raises(ValueError, match="'broadcast'"):
        plan_tree(Location("A0"), {}, "broadcast")


@pytest.mark.slow
def test_a_receiver_that_missed_a_version_gets_a_full_copy_and_one_that_kept_up_gets_deltas(ray_session):
    from streamrl.weights.engine import WeightPublisher, WeightReceiver

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    here = Location("A0", "A")
    pub = WeightPublisher("bfloat16", delta=True, bucket_mb=0.01, location=here)
    steady = WeightReceiver("gen-0", keep=True, location=Location("B0", "B"))
    behind = WeightReceiver("gen-1", keep=True, location=Location("B1", "B"))
    kinds: dict[str, list[str]] = {"gen-0": [], "gen-1": []}
    for v in range(4):
        if v:
            _adam_step(model, opt, v)
        handle = pub.publish(model.state_dict(), v)
        expected = flatten(to_wire(model.state_dict(), "bfloat16"), v).buffer
        for rx in (steady, behind):
            if rx is behind and v == 2:
                continue  # gen-1 misses version 2
            fw, rec = rx.receive(handle)
            kinds[rx.name].append(rec.kind)
            assert fw.buffer.tobytes() == expected.tobytes() and rec.link == "A->B"
        relayed = steady.relay(handle, steady.held)  # a relay's copy serves the same way
        fw, rec = WeightReceiver("gen-2", location=Location("B2", "B")).receive(relayed)
        assert fw.buffer.tobytes() == expected.tobytes() and rec.src == "gen-0" and rec.link == "B"
    assert kinds == {"gen-0": ["full", "delta", "delta", "delta"], "gen-1": ["full", "delta", "full"]}


@pytest.mark.slow
def test_instances_take_deltas_after_the_first_version_and_a_replacement_gets_a_full_copy(ray_session,
                                                                                         tiny_policy_dir):
    import os
    import signal

    import ray

    from streamrl.config import load_config
    from streamrl.models.tiny import load_policy
    from streamrl.sgs.service import StreamGenerationService
    from streamrl.weights.engine import WeightPublisher

    cfg = load_config(None, [f"policy.path={tiny_policy_dir}", "weights.delta=true", "weights.wire_dtype=bfloat16",
                             "task.num_eval=4"])
    model, _ = load_policy(tiny_policy_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)
    pub = WeightPublisher("bfloat16", delta=True)
    sgs = StreamGenerationService(cfg)
    try:
        sgs.add_instances(2)
        kinds = []
        for v in range(3):
            if v:
                x = torch.randint(0, model.config.vocab_size, (2, 16))
                model(input_ids=x, labels=x).loss.backward()
                opt.step()
                opt.zero_grad()
            kinds.append(sorted(r["kind"] for r in sgs.update(pub.publish(model.state_dict(), v), v)))
        assert kinds == [["full", "full"], ["delta", "delta"], ["delta", "delta"]]
        victim = sorted(sgs.instances)[0]
        os.kill(ray.get(sgs.instances[victim].pid.remote()), signal.SIGKILL)
        # nothing is assigned, so the death shows at the next update
        results = sgs.update(pub.publish(model.state_dict(), 3), 3)
        assert [r["kind"] for r in results] == ["delta"]  # the survivor; the replacement installs while starting
        assert sgs.counters["sgs/faults"] == 1 and victim not in sgs.instances
        fetched = {e.who: e.meta["kind"] for e in sgs.drain_events() if e.what == "weight_fetch" and e.version == 3}
        assert sorted(fetched.values()) == ["delta", "full"] and fetched[max(sgs.instances)] == "full"
        assert {ray.get(a.version.remote()) for a in sgs.instances.values()} == {3}
    finally:
        sgs.shutdown()


def test_tied_weights_are_sent_once_and_load_under_both_names():
    from streamrl.weights.flat import unflatten

    emb = torch.nn.Embedding(100, 16)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight  # tied, as a Qwen2 with tie_word_embeddings
    sd = {"embed.weight": emb.weight, "head.weight": head.weight, "other": torch.ones(8)}
    for wire in ("float32", "bfloat16"):
        fw = flatten(to_wire(sd, wire), 0)
        size = 2 if wire == "bfloat16" else 4
        assert fw.nbytes < 100 * 16 * size + 128  # one copy of the table (plus alignment), not two
        back = unflatten(fw)
        assert torch.equal(back["embed.weight"], back["head.weight"]) and set(back) == set(sd)

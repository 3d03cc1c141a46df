"""Flat weight buffers and their transports (Ray object store, gloo broadcast)."""

import os
import sys

import numpy as np
import pytest
import torch

from streamrl.weights.flat import ALIGN, FlatWeights, flat_buckets, flatten, load_into, unflatten
from streamrl.weights.transfer import (
    GlooBroadcastTransport,
    RayObjectStoreTransport,
    free_port,
    receive,
    send,
)


def make_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    m[2].to(torch.bfloat16)  # a mixed-dtype model, as with bf16 weights and fp32 norms
    return m


def mixed_state_dict() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "a.weight": torch.randn(3, 5),
        "b.weight": torch.randn(7, 2).to(torch.bfloat16),
        "c.bias": torch.randn(9).to(torch.float16),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 4),
        "noncontig": torch.randn(4, 6).t(),
    }


def test_flatten_round_trip_is_bit_exact_for_mixed_dtypes():
    sd = mixed_state_dict()
    fw = flatten(sd, version=3)
    assert fw.version == 3 and fw.buffer.dtype == np.uint8 and fw.buffer.flags.c_contiguous
    assert all(s.offset % ALIGN == 0 for s in fw.spec)
    out = unflatten(fw)
    assert list(out) == list(sd)
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and out[k].shape == v.shape, k
        assert torch.equal(out[k], v), k


@pytest.mark.parametrize("bucket_bytes", [64, 128, 1 << 20])
def test_buckets_made_one_at_a_time_hold_what_flatten_holds(bucket_bytes):
    """Tensors that span bucket boundaries, a tied pair, a non-contiguous one: the buckets,
    joined, unflatten to the same tensors under the same spec, and each is at most one bucket."""
    sd = mixed_state_dict()
    sd["tied"] = sd["a.weight"]
    fw = flatten(sd, version=1)
    spec, total, buckets = flat_buckets(sd, bucket_bytes)
    parts = list(buckets)
    assert spec == fw.spec and total == fw.nbytes and all(len(b) <= bucket_bytes for b in parts)
    assert len(parts) == -(-total // bucket_bytes)
    out = unflatten(FlatWeights(np.concatenate(parts), spec, 1))
    for k, v in sd.items():
        assert out[k].dtype == v.dtype and torch.equal(out[k], v), k


def test_unflatten_views_share_the_buffer_and_copy_does_not():
    fw = flatten({"w": torch.ones(4)}, version=0)
    view, owned = unflatten(fw)["w"], unflatten(fw, copy=True)["w"]
    fw.buffer[:] = 0
    assert torch.equal(view, torch.zeros(4)) and torch.equal(owned, torch.ones(4))


def test_load_into_updates_module_in_place():
    src, dst = make_model(1), make_model(2)
    ptrs = {k: v.data_ptr() for k, v in dst.state_dict().items()}
    params = list(dst.parameters())
    nbytes = load_into(dst, flatten(src.state_dict(), version=1))
    assert nbytes == sum(v.numel() * v.element_size() for v in src.state_dict().values())
    assert {k: v.data_ptr() for k, v in dst.state_dict().items()} == ptrs
    assert all(p is q for p, q in zip(params, dst.parameters()))
    for k, v in src.state_dict().items():
        assert torch.equal(dst.state_dict()[k], v), k


def test_load_into_names_the_offending_key_and_changes_nothing():
    dst = make_model(2)
    before = {k: v.clone() for k, v in dst.state_dict().items()}
    good = make_model(1).state_dict()
    bad_shape = dict(good, **{"0.weight": torch.zeros(16, 9)})
    with pytest.raises(ValueError, match=r"'0.weight'.*\(16, 8\).*\(16, 9\)"):
        load_into(dst, flatten(bad_shape, version=1))
    bad_dtype = dict(good, **{"2.weight": good["2.weight"].float()})
    with pytest.raises(ValueError, match=r"'2.weight'.*bfloat16.*float32"):
        load_into(dst, flatten(bad_dtype, version=1))
    missing = {k: v for k, v in good.items() if k != "1.bias"}
    with pytest.raises(KeyError, match=r"1.bias"):
        load_into(dst, flatten(missing, version=1))
    with pytest.raises(KeyError, match=r"extra"):
        load_into(dst, flatten(dict(good, extra=torch.zeros(1)), version=1))
    for k, v in dst.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_flat_weights_rejects_a_wrong_buffer():
    with pytest.raises(ValueError, match="uint8"):
        FlatWeights(np.zeros(4, dtype=np.float32), [], 0)


# ---------------------------------------------------------------- through Ray


@pytest.fixture(scope="module")
def ray_ctx():
    """Reuses a running Ray (a session fixture's) or starts one for this module."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/
    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


class Receiver:
    """A stand-in for a generation instance: holds its own model, loads what it is sent."""

    def __init__(self, seed: int):
        torch.set_num_threads(1)
        self.model = make_model(seed)
        self.gloo = None

    def receive(self, transport, handle):
        ptrs = [p.data_ptr() for p in self.model.parameters()]
        records = receive(transport, handle, self.model, dst="gen-0")
        assert ptrs == [p.data_ptr() for p in self.model.parameters()], "parameters were re-allocated"
        return records, {k: v.clone() for k, v in self.model.state_dict().items()}

    def join_gloo(self, addr: str, port: int):
        self.gloo = GlooBroadcastTransport(1, 2, addr, port, timeout_s=60)

    def receive_gloo(self, handle):
        return self.receive(self.gloo, handle)


@pytest.fixture(scope="module")
def receiver(ray_ctx):
    actor = ray_ctx.remote(num_cpus=0)(Receiver).remote(seed=2)
    yield actor
    ray_ctx.kill(actor)


@pytest.mark.slow
def test_actor_loads_weights_from_the_object_store(ray_ctx, receiver):
    src = make_model(1)
    transport = RayObjectStoreTransport()
    handle, send_records = send(transport, src.state_dict(), version=5)
    records, state = ray_ctx.get(receiver.receive.remote(transport, handle))
    for k, v in src.state_dict().items():
        assert torch.equal(state[k], v), k
    assert [r.kind for r in send_records + records] == ["flatten", "publish", "fetch", "load"]
    for r in send_records + records:
        assert r.version == 5 and r.bytes == handle.nbytes and r.bandwidth_bytes_per_s > 0
    assert records[0].dst == "gen-0" and records[0].transport == "ray"


@pytest.mark.slow
def test_actor_loads_weights_from_a_gloo_broadcast(ray_ctx, receiver):
    port = free_port()
    joined = receiver.join_gloo.remote("127.0.0.1", port)  # both ranks must join at once
    gloo = GlooBroadcastTransport(0, 2, "127.0.0.1", port, timeout_s=60)
    ray_ctx.get(joined)
    for version, seed in [(6, 3), (7, 4)]:
        src = make_model(seed)
        handle, _ = send(gloo, src.state_dict(), version=version)
        records, state = ray_ctx.get(receiver.receive_gloo.remote(handle))
        for k, v in src.state_dict().items():
            assert torch.equal(state[k], v), (version, k)
        assert records[0].transport == "gloo" and records[0].bytes == handle.nbytes
    gloo.close()

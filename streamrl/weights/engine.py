"""The network-aware weight engine: versioned buffers, bf16 on the wire, deltas, relays.

    trainer   WeightPublisher.publish(state_dict, v): flatten in the wire dtype, ray.put the full
              buffer [+ the delta v-1 -> v] -> WeightHandle(v, refs, base v-1, checksum, origin)
    driver    plan_tree (weights.tree) gives each receiver a parent; tree_calls sends it the
              parent's handle (the trainer's, or a relay's result: Ray resolves it first)
    instance  WeightReceiver.receive(handle): the delta when it holds base v-1, else the full copy;
              WeightReceiver.relay(handle, fw): ray.put of its own copy (and the delta) for children

Invariants: a version is CRC-checked whether rebuilt from a delta or fetched whole (when the
handle has a checksum); a child fetches its parent's own object, so the slow link carries one
copy per site (``WeightReceiver.relay``); every fetch returns a ``FetchRecord`` for the timeline.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Mapping

import torch

from streamrl.weights.delta import Delta, apply_delta, checksum, make_delta
from streamrl.weights.flat import FlatWeights, flat_buckets, flatten, storage_key
from streamrl.weights.transfer import WeightHandle, fetch_buffer, get_in_windows
from streamrl.weights.tree import Location

WIRE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def here() -> Location:
    """This process's Ray node label (its ``node_<label>`` resource, else the node id's first
    characters) and site (its ``site_<S>`` resource, else ``""``)."""
    import ray

    node_id = ray.get_runtime_context().get_node_id()
    res: dict = {}
    for n in ray.nodes():
        if n["NodeID"] == node_id:
            res = n.get("Resources", {})
            break
    node = next((k[len("node_"):] for k in sorted(res) if k.startswith("node_")), node_id[:8])
    site = next((k[len("site_"):] for k in sorted(res) if k.startswith("site_")), "")
    return Location(node, site)


def to_wire(state_dict: Mapping[str, torch.Tensor], wire_dtype: str) -> dict[str, torch.Tensor]:
    """Floating-point tensors cast to the wire dtype (others as they are). ``"bfloat16"`` halves
    the bytes; the receiver's parameters keep their own dtype (``copy_`` upcasts)."""
    if wire_dtype not in WIRE_DTYPES:
        raise ValueError(f"weights.wire_dtype {wire_dtype!r}: choose one of {', '.join(WIRE_DTYPES)}")
    dtype = WIRE_DTYPES[wire_dtype]
    cast: dict[tuple, torch.Tensor] = {}  # one cast per storage: tied tensors stay one tensor
    out = {}
    for k, v in state_dict.items():
        v = v.detach()
        if v.is_floating_point() and v.dtype != dtype:
            key = storage_key(v)
            if key not in cast:
                cast[key] = v.to(dtype)
            v = cast[key]
        out[k] = v
    return out


@dataclass(frozen=True)
class FetchRecord:
    """One receiver's fetch of one version: what crossed which link, how long it took."""

    version: int
    kind: str
    """``full`` or ``delta``."""
    bytes: int
    """Bytes fetched (the full buffer, or the delta's payload)."""
    seconds: float
    """The network part: until the bytes were here."""
    src: str
    dst: str
    link: str
    """``"A->B"`` across sites, ``"A"`` inside site A, ``"local"`` when neither is labelled."""
    start: float
    """Wall clock (``time.time()``)."""
    apply_s: float = 0.0
    """Rebuilding the version from a delta and checking its checksum, after the fetch."""

    def as_meta(self) -> dict:
        return {"bytes": self.bytes, "kind": self.kind, "src": self.src, "link": self.link, "apply_s": self.apply_s}


def link_name(src_site: str, dst_site: str) -> str:
    if src_site == dst_site:
        return src_site or "local"
    return f"{src_site or '?'}->{dst_site or '?'}"


def put_buckets(buf, bucket_bytes: int) -> list:
    """``buf`` as consecutive bucket objects in this process's object store (their refs, in order)."""
    import ray

    return [ray.put(buf[s:s + bucket_bytes]) for s in range(0, max(buf.nbytes, 1), bucket_bytes)]


def put_buckets_of(delta: Delta) -> list:
    """Each bucket of ``delta`` as its own object (their refs, in order)."""
    import ray

    return [ray.put(b) for b in delta.buckets]


def _fetch_delta(handle: WeightHandle) -> Delta:
    """The delta's buckets, a window at a time (see ``transfer.fetch_buffer``)."""
    buckets = tuple(get_in_windows(handle.delta, handle.delta_nbytes))
    return Delta(handle.base, handle.version, handle.nbytes, handle.checksum, buckets)


def bucket_size(bucket_mb: float) -> int:
    """``weights.bucket_mb`` in bytes, a multiple of 64 (at least 64)."""
    return max(64, int(bucket_mb * 2**20) // 64 * 64)


class WeightPublisher:
    """The trainer's side: versioned buffers put as ``bucket_mb`` buckets; ``delta=True`` keeps
    the last published buffer to diff against."""

    def __init__(self, wire_dtype: str = "float32", delta: bool = False, bucket_mb: float = 16.0,
                 name: str = "trainer", location: Location | None = None) -> None:
        to_wire({}, wire_dtype)  # validates the name
        self.wire_dtype, self.delta, self.name = wire_dtype, delta, name
        self.bucket_bytes = bucket_size(bucket_mb)
        self._location = location
        self._prev: FlatWeights | None = None
        self.last_delta_fraction: float | None = None

    @property
    def location(self) -> Location:
        if self._location is None:
            self._location = here()
        return self._location

    def publish(self, state_dict: Mapping[str, torch.Tensor], version: int) -> WeightHandle:
        loc = self.location
        if not self.delta:  # each bucket made and put in turn: no flat copy of the whole state is held
            import ray

            spec, total, buckets = flat_buckets(to_wire(state_dict, self.wire_dtype), self.bucket_bytes)
            refs = tuple(ray.put(b) for b in buckets)
            return WeightHandle(int(version), total, tuple(spec), "ray", list(refs), origin=self.name,
                                origin_site=loc.site, origin_node=loc.node)
        fw = flatten(to_wire(state_dict, self.wire_dtype), version, {"src": self.name})
        delta_refs, base, delta_nbytes, crc = None, None, 0, None
        if self.delta:
            prev = self._prev
            if prev is not None and prev.spec == fw.spec and prev.version < fw.version:
                d = make_delta(prev.buffer, fw.buffer, prev.version, fw.version, self.bucket_bytes)
                delta_refs, base, delta_nbytes, crc = put_buckets_of(d), prev.version, d.nbytes, d.checksum
                self.last_delta_fraction = d.changed_fraction
            else:
                crc = checksum(fw.buffer)
            self._prev = fw
        return WeightHandle(fw.version, fw.nbytes, tuple(fw.spec), "ray", put_buckets(fw.buffer, self.bucket_bytes),
                            delta=delta_refs, base=base, delta_nbytes=delta_nbytes, checksum=crc, origin=self.name,
                            origin_site=loc.site, origin_node=loc.node)


class WeightReceiver:
    """An instance's side: fetch a version (a delta when it holds the base), keep the buffer
    for the next delta when ``keep``, and re-publish its copy when it relays."""

    def __init__(self, name: str, keep: bool = False, location: Location | None = None,
                 bucket_mb: float = 16.0) -> None:
        self.name, self.keep = name, keep
        self.bucket_bytes = bucket_size(bucket_mb)
        self._location = location
        self.held: FlatWeights | None = None
        self._last_delta: Delta | None = None

    @property
    def location(self) -> Location:
        if self._location is None:
            self._location = here()
        return self._location

    def receive(self, handle: WeightHandle) -> tuple[FlatWeights, FetchRecord]:
        if handle.transport != "ray":
            raise ValueError(f"WeightReceiver fetches from the Ray object store, got a {handle.transport!r} handle")
        wall, t0 = time.time(), time.perf_counter()
        held = self.held
        self._last_delta = None
        if handle.delta is not None and held is not None and held.version == handle.base:
            delta = _fetch_delta(handle)
            t1 = time.perf_counter()
            buf = apply_delta(held.buffer, delta, held.version)
            kind, nbytes = "delta", handle.delta_nbytes
            self._last_delta = delta
        else:
            buf = fetch_buffer(handle)
            t1 = time.perf_counter()
            if handle.checksum is not None and checksum(buf) != handle.checksum:
                raise ValueError(f"version {handle.version} from {handle.origin}: checksum mismatch on a full copy")
            kind, nbytes = "full", handle.nbytes
        fw = FlatWeights(buf, list(handle.spec), handle.version)
        if self.keep:
            self.held = fw
        rec = FetchRecord(handle.version, kind, int(nbytes), t1 - t0, handle.origin, self.name,
                          link_name(handle.origin_site, self.location.site), wall, time.perf_counter() - t1)
        return fw, rec

    def relay(self, handle: WeightHandle, fw: FlatWeights) -> WeightHandle:
        """A handle of this process's own copy of ``fw`` (received through ``handle``), so that
        children fetch from this node; the delta it received is re-offered with it.

        Why re-publish instead of letting children fetch the trainer's object: Ray's object
        manager may pull from any node holding a copy, so which link a naive fetch crosses is up
        to Ray; a relay's own object lives only on the relay's node, so a child in the same site
        pulls it inside the site and the slow link carries one copy per site (measured by
        ``streamrl bench weights``: docs/results.md)."""
        loc = self.location
        delta_refs = put_buckets_of(self._last_delta) if self._last_delta is not None else None
        return WeightHandle(fw.version, fw.nbytes, tuple(fw.spec), "ray", put_buckets(fw.buffer, self.bucket_bytes),
                            delta=delta_refs, base=handle.base if delta_refs is not None else None,
                            delta_nbytes=handle.delta_nbytes if delta_refs is not None else 0,
                            checksum=handle.checksum, origin=self.name, origin_site=loc.site, origin_node=loc.node)


def delta_fraction(old: Mapping[str, torch.Tensor], new: Mapping[str, torch.Tensor], wire_dtype: str = "bfloat16",
                   bucket_mb: float = 16.0) -> float:
    """Delta payload / full copy between two state dicts, in the wire dtype (no Ray)."""
    a = flatten(to_wire(old, wire_dtype), 0)
    b = flatten(to_wire(new, wire_dtype), 1)
    return make_delta(a.buffer, b.buffer, 0, 1, max(2, int(bucket_mb * 2**20))).changed_fraction



def resolve(arg) -> WeightHandle:
    """The handle a receiver was sent: the publisher's, or its relay's result (``{"handle": ...}``)
    that Ray resolved before the call."""
    if isinstance(arg, dict):
        if arg.get("handle") is None:
            raise ValueError("a weight update was chained to a receiver that did not relay")
        return arg["handle"]
    return arg


def tree_calls(handle: WeightHandle, parents: dict[str, str | None], call) -> dict[str, object]:
    """Start every receiver's update at once, in tree order: ``call(name, src, relay)`` returns
    an ObjectRef; ``src`` is ``handle`` for the publisher's children and the parent's ObjectRef
    otherwise (Ray starts the child once the parent's result, with its relay handle, is ready)."""
    from streamrl.weights.tree import levels

    relays = {p for p in parents.values() if p is not None}
    refs: dict[str, object] = {}
    for level in levels(parents):
        for name in level:
            parent = parents[name]
            refs[name] = call(name, handle if parent is None else refs[parent], name in relays)
    return refs

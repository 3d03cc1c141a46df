"""Versioned weight transport: the trainer publishes a FlatWeights, generation instances fetch it.

    trainer:   handle = transport.publish(flatten(model.state_dict(), version))
    driver:    passes ``handle`` (a few KB: version, spec, object ref) to every instance
    instance:  load_into(engine_model, transport.fetch(handle))

Two implementations: ``RayObjectStoreTransport`` (``ray.put`` paid once per version however many
instances fetch; same-node fetches are zero-copy) and ``GlooBroadcastTransport`` (a collective
that avoids the object-store copy; measured: docs/results.md). ``send``/``receive`` wrap
flatten/publish and fetch/load with timing and return one ``TransferRecord`` per leg, so every
transfer's bytes, seconds and bandwidth are data; its wall-clock ``start`` lines records of
different processes up on one timeline (``metrics/timeline.py``: ``weight_push``/``weight_load``).
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import numpy as np
import torch

from streamrl.weights.flat import FlatWeights, TensorSpec, flatten, load_into


@dataclass(frozen=True)
class TransferRecord:
    """One timed leg of a weight transfer."""

    version: int
    """Policy version of the weights moved."""
    bytes: int
    """Size of the flat buffer (the same for every leg of one transfer)."""
    seconds: float
    bandwidth_bytes_per_s: float
    """``bytes / seconds`` (``inf`` when the leg took no measurable time)."""
    src: str
    """Who sends (``"trainer"``)."""
    dst: str
    """Who receives (``"gen-0"``; ``"*"`` for a publish that any reader may fetch)."""
    kind: str
    """The leg: ``"flatten"`` (copy into the flat buffer), ``"publish"`` (hand it to the
    transport), ``"fetch"`` (receive it), ``"load"`` (copy into the receiver's parameters)."""
    transport: str = ""
    """``"ray"`` or ``"gloo"`` (empty for the transport-independent legs)."""
    start: float = 0.0
    """Wall-clock start of the leg (``time.time()``), comparable across processes on one node."""


def _record(version, nbytes, start_wall, t0, src, dst, kind, transport="") -> TransferRecord:
    seconds = time.perf_counter() - t0
    bw = nbytes / seconds if seconds > 0 else float("inf")
    return TransferRecord(version, nbytes, seconds, bw, src, dst, kind, transport, start_wall)


@dataclass(frozen=True)
class WeightHandle:
    """What travels from publisher to receivers (small): enough to fetch and rebuild the weights."""

    version: int
    nbytes: int
    spec: tuple[TensorSpec, ...]
    transport: str
    """Name of the transport that made it; ``fetch`` rejects another transport's handle."""
    payload: Any
    """Transport-specific: a Ray ObjectRef of the buffer or a list of them (its buckets, in
    order), or the gloo broadcast sequence number."""
    delta: Any = None
    """Ray ObjectRefs of the ``weights.delta.DeltaBucket``s from version ``base`` (``weights.delta``);
    None when the publisher sends full copies only or has no previous version."""
    base: int | None = None
    """The version ``delta`` applies to."""
    delta_nbytes: int = 0
    """Payload bytes of ``delta`` (what crosses the link instead of ``nbytes``)."""
    checksum: int | None = None
    """CRC32 of the full buffer (set when deltas are on): a rebuilt buffer must match it."""
    origin: str = "trainer"
    """Who put the buffer: the trainer, or the relay instance that re-published its copy."""
    origin_site: str = ""
    """The origin's site (``""`` unlabelled) and node label: the receiver names the link with them."""
    origin_node: str = ""


class WeightTransport(ABC):
    """Moves FlatWeights from one publisher to many receivers."""

    name: str = "?"

    @abstractmethod
    def publish(self, fw: FlatWeights) -> WeightHandle:
        """Make ``fw`` available to receivers; may return before they have it."""

    @abstractmethod
    def fetch(self, handle: WeightHandle) -> FlatWeights:
        """The weights ``handle`` names (blocks until they are here)."""

    def _check(self, handle: WeightHandle) -> None:
        if handle.transport != self.name:
            raise ValueError(f"{self.name} transport got a handle from {handle.transport!r} (version {handle.version})")


class RayObjectStoreTransport(WeightTransport):
    """``ray.put`` of the flat numpy buffer; stateless, so it can be passed to actors.

    ``publish`` is one ``ray.put`` of the numpy buffer; ``fetch`` is ``ray.get``, zero-copy on
    the same node (the buffer is read-only shared memory), one node-to-node copy otherwise.
    Handles may be fetched by any number of readers, in any order, any number of times; the
    object lives while some handle (its ObjectRef) is alive and while its owner (the process
    that published) lives."""

    name = "ray"

    def publish(self, fw: FlatWeights) -> WeightHandle:
        import ray

        ref = ray.put(fw.buffer)
        return WeightHandle(fw.version, fw.nbytes, tuple(fw.spec), self.name, ref)

    def fetch(self, handle: WeightHandle) -> FlatWeights:
        self._check(handle)
        return FlatWeights(fetch_buffer(handle), list(handle.spec), handle.version)


FETCH_WINDOW_BYTES = 64 << 20
"""Bytes of bucket objects in flight at a time (``fetch_window``): four 16 MB buckets."""


def fetch_window(total_bytes: int, buckets: int) -> int:
    """How many of ``buckets`` objects (``total_bytes`` in all) to fetch at once: as many as fit
    in ``FETCH_WINDOW_BYTES``, at least one."""
    per = max(1, total_bytes // max(buckets, 1))
    return max(1, FETCH_WINDOW_BYTES // per)


def get_in_windows(refs: list, total_bytes: int):
    """The objects behind ``refs`` (``total_bytes`` in all), in order, ``fetch_window`` at a time."""
    import ray

    window = fetch_window(total_bytes, len(refs))
    for i in range(0, len(refs), window):
        yield from ray.get(refs[i:i + window])


def fetch_buffer(handle: WeightHandle) -> np.ndarray:
    """The full buffer behind a Ray handle: one object (zero-copy on its node), or a list of
    bucket objects fetched ``fetch_window`` at a time into one buffer. Why a window: Ray
    re-requests an object that has not arrived within its pull timeout (10 s), so one large
    object, or many pulled at once, over a slow link crosses it several times (measured:
    3.6 copies of a 250 MB buffer per receiver at 200 Mbit/s); a few bucket-sized objects at a
    time each arrive well within it."""
    import ray

    payload = handle.payload
    if not isinstance(payload, list):
        buf = ray.get(payload)
    else:
        buf = np.empty(handle.nbytes, dtype=np.uint8)
        at = 0
        for part in get_in_windows(payload, handle.nbytes):
            buf[at:at + part.nbytes] = part
            at += part.nbytes
        if at != handle.nbytes:
            raise ValueError(f"fetched {at} bytes in {len(payload)} buckets for version {handle.version}, "
                             f"handle says {handle.nbytes}")
    if buf.nbytes != handle.nbytes:
        raise ValueError(f"fetched {buf.nbytes} bytes for version {handle.version}, handle says {handle.nbytes}")
    return buf


def free_port() -> int:
    """An unused TCP port on this host (for the gloo rendezvous; call it on the rank-0 process)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class GlooBroadcastTransport(WeightTransport):
    """A private gloo group (not the default torch.distributed group, so a trainer can keep its
    own); rank 0 publishes, every other rank fetches every handle in order.

    ``publish`` starts one asynchronous broadcast of the buffer and returns at once; ``fetch``
    joins it. A broadcast is a collective: every receiver must fetch every handle, in publish
    order (checked by sequence number), and all ranks must construct the transport concurrently
    (the constructor is a rendezvous)."""

    name = "gloo"

    def __init__(self, rank: int, world_size: int, master_addr: str, master_port: int, timeout_s: float = 300.0):
        import torch.distributed as dist

        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} not in [0, {world_size})")
        self.rank, self.world_size = rank, world_size
        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0, timeout=timeout)
        self._pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        self._seq = 0  # publisher: broadcasts started; receiver: broadcasts joined
        self._pending: tuple[Any, FlatWeights] | None = None  # publisher's in-flight broadcast

    def publish(self, fw: FlatWeights) -> WeightHandle:
        if self.rank != 0:
            raise RuntimeError(f"only rank 0 publishes; this is rank {self.rank}")
        self.wait()  # one broadcast in flight at a time: receivers join them in order anyway
        if not fw.buffer.flags.writeable:  # torch.from_numpy needs a writable array
            fw = FlatWeights(fw.buffer.copy(), fw.spec, fw.version, fw.meta)
        work = self._pg.broadcast(torch.from_numpy(fw.buffer), 0)
        self._pending = (work, fw)  # keeps the buffer alive until the broadcast completes
        handle = WeightHandle(fw.version, fw.nbytes, tuple(fw.spec), self.name, self._seq)
        self._seq += 1
        return handle

    def wait(self) -> None:
        """Publisher: block until the last broadcast has reached every receiver."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None

    def fetch(self, handle: WeightHandle) -> FlatWeights:
        self._check(handle)
        if self.rank == 0:
            raise RuntimeError("rank 0 is the publisher; it does not fetch")
        if handle.payload != self._seq:
            raise RuntimeError(
                f"gloo broadcasts must be fetched in order: expected #{self._seq}, got #{handle.payload} "
                f"(version {handle.version})"
            )
        buf = np.empty(handle.nbytes, dtype=np.uint8)
        self._pg.broadcast(torch.from_numpy(buf), 0).wait()
        self._seq += 1
        return FlatWeights(buf, list(handle.spec), handle.version)

    def close(self) -> None:
        self.wait()
        self._pg = None


def send(
    transport: WeightTransport, state_dict: Mapping[str, torch.Tensor], version: int, src: str = "trainer"
) -> tuple[WeightHandle, list[TransferRecord]]:
    """flatten + publish, timed: returns the handle and the ``flatten`` and ``publish`` records."""
    w0, t0 = time.time(), time.perf_counter()
    fw = flatten(state_dict, version, {"src": src})
    rec_flat = _record(version, fw.nbytes, w0, t0, src, src, "flatten")
    w1, t1 = time.time(), time.perf_counter()
    handle = transport.publish(fw)
    rec_pub = _record(version, fw.nbytes, w1, t1, src, "*", "publish", transport.name)
    return handle, [rec_flat, rec_pub]


def receive(
    transport: WeightTransport,
    handle: WeightHandle,
    target: torch.nn.Module | Mapping[str, torch.Tensor],
    dst: str,
    src: str = "trainer",
) -> list[TransferRecord]:
    """fetch + load_into ``target`` in place, timed: returns the ``fetch`` and ``load`` records."""
    w0, t0 = time.time(), time.perf_counter()
    fw = transport.fetch(handle)
    rec_fetch = _record(handle.version, handle.nbytes, w0, t0, src, dst, "fetch", transport.name)
    w1, t1 = time.time(), time.perf_counter()
    load_into(target, fw)
    rec_load = _record(handle.version, handle.nbytes, w1, t1, src, dst, "load")
    return [rec_fetch, rec_load]

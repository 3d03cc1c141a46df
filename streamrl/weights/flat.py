"""Flat weight buffers: a whole state dict as ONE contiguous byte buffer plus a small spec.

One numpy buffer goes through Ray's object store by reference (zero-copy for readers on the same
node) or through a single gloo broadcast (``transfer.py``); a pickled dict of tensors is one
object per tensor and slow to pickle (figures: docs/design.md). One weight update::

    trainer state_dict --flatten()--> FlatWeights(buffer, spec, version)      [1 copy / tensor]
        --transport (ray.put / gloo broadcast)--> FlatWeights on the receiver  [0 or 1 copy]
        --load_into(module, fw)--> module parameters, updated in place         [1 copy / tensor]

Invariants: the buffer is always ``uint8`` (numpy has no bfloat16: the dtype is a string in the
spec) and every tensor starts at an ``ALIGN``-byte offset, so its ``torch.frombuffer`` view is aligned.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np
import torch

ALIGN = 64
"""Byte alignment of each tensor's offset in the buffer (cache line; enough for any dtype)."""

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
"""Dtypes a FlatWeights can carry, by the name stored in the spec."""

_DTYPE_NAMES = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class TensorSpec:
    """Where one tensor lives in the flat buffer."""

    name: str
    """State-dict key (``"model.layers.0.mlp.up_proj.weight"``)."""
    shape: tuple[int, ...]
    dtype: str
    """A key of ``DTYPES``."""
    offset: int
    """Byte offset in the buffer (a multiple of ``ALIGN``)."""
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize


@dataclass
class FlatWeights:
    """A state dict as one contiguous ``uint8`` numpy buffer, its layout and policy version."""

    buffer: np.ndarray
    """1-D ``uint8``, C-contiguous; may be read-only (fetched from Ray's object store). Each
    tensor's raw bytes are in its dtype's native little-endian encoding, bf16 included."""
    spec: list[TensorSpec]
    """One entry per tensor, in the state dict's order."""
    version: int
    """Policy version of these weights (the trainer's optimizer-step count at publish time)."""
    meta: dict = field(default_factory=dict)
    """Free-form, JSON-able extras (e.g. ``{"src": "trainer"}``); never read by ``load_into``."""

    def __post_init__(self) -> None:
        b = self.buffer
        if not isinstance(b, np.ndarray) or b.dtype != np.uint8 or b.ndim != 1 or not b.flags.c_contiguous:
            raise ValueError(
                f"FlatWeights.buffer must be a 1-D C-contiguous uint8 numpy array, got "
                f"{type(b).__name__} dtype={getattr(b, 'dtype', None)} ndim={getattr(b, 'ndim', None)}"
            )
        end = max((s.offset + s.nbytes for s in self.spec), default=0)
        if end > b.nbytes:
            raise ValueError(f"spec needs {end} bytes but buffer holds {b.nbytes} (version {self.version})")

    @property
    def nbytes(self) -> int:
        return int(self.buffer.nbytes)

    def names(self) -> list[str]:
        return [s.name for s in self.spec]


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _dtype_name(name: str, t: torch.Tensor) -> str:
    try:
        return _DTYPE_NAMES[t.dtype]
    except KeyError:
        raise TypeError(f"tensor {name!r} has unsupported dtype {t.dtype}; supported: {sorted(DTYPES)}") from None


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's raw bytes as a flat uint8 numpy array (a view when it is a contiguous CPU
    tensor). Copying through numpy: torch's uint8 ``copy_`` measured 4-5x slower (150 vs 30 ms
    for 50 MB)."""
    t = t.detach().cpu().contiguous().reshape(-1)
    if t.dtype == torch.bool:  # bool cannot be .view()-ed as uint8 in every torch build
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy()


def storage_key(t: torch.Tensor) -> tuple:
    """Identifies a tensor's bytes: two names with the same key are one tensor (tied weights)."""
    return (t.device.type, t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)


def layout(state_dict: Mapping[str, torch.Tensor]) -> tuple[list[TensorSpec], list[tuple[TensorSpec, torch.Tensor]], int]:
    """Where each tensor of ``state_dict`` goes in the flat buffer: every name's spec, the
    tensors to copy (tied ones once: both specs point at the same bytes), and the total size."""
    spec: list[TensorSpec] = []
    offset = 0
    first: dict[tuple, int] = {}  # storage_key -> offset of its first name
    copies: list[tuple[TensorSpec, torch.Tensor]] = []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, not a torch.Tensor")
        key = storage_key(t)
        if t.numel() and key in first:
            spec.append(TensorSpec(name, tuple(t.shape), _dtype_name(name, t), first[key], t.numel()))
            continue
        ts = TensorSpec(name, tuple(t.shape), _dtype_name(name, t), offset, t.numel())
        spec.append(ts)
        copies.append((ts, t))
        if t.numel():
            first[key] = offset
        offset = _align(offset + ts.nbytes)
    return spec, copies, offset


def flatten(state_dict: Mapping[str, torch.Tensor], version: int, meta: dict | None = None) -> FlatWeights:
    """Copy every tensor of ``state_dict`` into one new aligned ``uint8`` buffer. Tensors that
    are one storage under two names (tied embeddings) are stored once: both specs point at the
    same bytes, so the buffer, and every transfer of it, carries them once. Exactly one copy of
    every tensor into the buffer (plus a device->host copy for accelerator tensors, and a
    contiguity copy for non-contiguous ones)."""
    spec, copies, total = layout(state_dict)
    buffer = np.empty(total, dtype=np.uint8)
    for ts, t in copies:
        if ts.numel:
            buffer[ts.offset : ts.offset + ts.nbytes] = _as_bytes(t)
    return FlatWeights(buffer, spec, int(version), dict(meta or {}))


def flat_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int):
    """``(spec, total, buckets)``: the bytes ``flatten`` would produce, as consecutive
    ``bucket_bytes`` arrays made one at a time (``buckets`` is a generator), so a sender that
    ships each bucket before asking for the next never holds the whole flat copy."""
    spec, copies, total = layout(state_dict)

    def buckets():
        i = 0  # the first copy that may still reach into this bucket
        for start in range(0, max(total, 1), bucket_bytes):
            end = min(start + bucket_bytes, total)
            out = np.zeros(end - start, dtype=np.uint8)  # zeros in the alignment gaps
            while i < len(copies) and copies[i][0].offset + copies[i][0].nbytes <= start:
                i += 1
            for ts, t in copies[i:]:
                if ts.offset >= end:
                    break
                if not ts.numel:
                    continue
                lo, hi = max(ts.offset, start), min(ts.offset + ts.nbytes, end)
                out[lo - start:hi - start] = _as_bytes(t)[lo - ts.offset:hi - ts.offset]
            yield out

    return spec, total, buckets()


def _view(fw: FlatWeights, ts: TensorSpec) -> torch.Tensor:
    """A zero-copy tensor over ``ts``'s bytes in ``fw.buffer`` (read-only if the buffer is)."""
    dtype = DTYPES[ts.dtype]
    if ts.numel == 0:
        return torch.empty(ts.shape, dtype=dtype)
    with warnings.catch_warnings():
        # Ray hands back read-only shared memory; torch warns that it cannot mark the view read-only.
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        flat = torch.frombuffer(fw.buffer, dtype=dtype, count=ts.numel, offset=ts.offset)
    return flat.view(ts.shape)


def unflatten(fw: FlatWeights, copy: bool = False) -> dict[str, torch.Tensor]:
    """The state dict back: views of ``fw.buffer`` (``copy=False``) or owned clones (``copy=True``).

    Views cost no copy and keep ``fw.buffer`` alive. A buffer fetched from Ray's object store is
    read-only shared memory: do not write into its views (torch cannot mark them read-only).
    """
    out = {}
    for ts in fw.spec:
        v = _view(fw, ts)
        out[ts.name] = v.clone() if copy else v
    return out


def load_into(target: torch.nn.Module | Mapping[str, torch.Tensor], fw: FlatWeights, strict: bool = True) -> int:
    """Copy ``fw`` into ``target``'s existing tensors in place; returns the bytes copied.

    ``target`` is a module (its ``state_dict()``, whose tensors share storage with the
    parameters and buffers) or a dict of tensors. Shapes and dtypes must match exactly; with
    ``strict`` the key sets must match too. All checks run before the first copy, so a mismatch
    leaves ``target`` untouched. Tied weights (two keys, one storage) are simply written twice.
    One copy per tensor into the existing storage; nothing is re-allocated.
    """
    dst = target.state_dict() if isinstance(target, torch.nn.Module) else target
    src_names = set(fw.names())
    missing = [k for k in dst if k not in src_names]
    unexpected = [k for k in fw.names() if k not in dst]
    if unexpected or (strict and missing):
        raise KeyError(
            f"load_into(version {fw.version}): keys in weights but not in target: {unexpected[:5]}"
            f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)}); keys in target but not in "
            f"weights: {missing[:5]}{' ...' if len(missing) > 5 else ''} ({len(missing)})"
        )
    for ts in fw.spec:
        t = dst[ts.name]
        if tuple(t.shape) != ts.shape or t.dtype != DTYPES[ts.dtype]:
            raise ValueError(
                f"load_into(version {fw.version}): {ts.name!r} target is {tuple(t.shape)} {t.dtype}, "
                f"weights are {ts.shape} {ts.dtype}"
            )
    copied = 0
    with torch.no_grad():
        for ts in fw.spec:
            if ts.numel:
                dst[ts.name].copy_(_view(fw, ts))
                copied += ts.nbytes
    return copied

"""Lossless weight deltas: send only the words that changed since the version a receiver holds.

Between two consecutive RL steps at an LLM learning rate (1e-6), most bf16 weights round to the
same value, so a full copy over a slow cross-datacenter link is mostly repeats. A delta carries,
per bucket of the flat buffer, whichever encoding of the changes is smallest (``raw``, ``idx``
or ``mask``: ``DeltaBucket.kind``). Invariants: words are 16 bits whatever the tensor dtypes
(every tensor starts at a 64-byte offset, ``flat.ALIGN``, so a changed byte always lies in a
changed word and no dtype needs to be known); the receiver checks a CRC32 of the whole rebuilt
buffer against the sender's, so a delta gives bit-identical weights or ``apply_delta`` raises
``DeltaError``; a receiver that does not hold the base gets a full copy instead
(``weights.engine``). Pure numpy: no Ray, no torch.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import numpy as np

WORD = np.dtype("<u2")
"""The unit of comparison: 16-bit little-endian words (one bf16 value)."""


class DeltaError(ValueError):
    """A delta that cannot be applied: wrong base version, wrong size, or a checksum mismatch."""


def checksum(buf: np.ndarray) -> int:
    """CRC32 of a uint8 buffer (zlib's: about a GB/s, enough beside a network transfer)."""
    return zlib.crc32(memoryview(np.ascontiguousarray(buf))) & 0xFFFFFFFF


@dataclass(frozen=True)
class DeltaBucket:
    """The changes of one byte range ``[start, end)`` of the flat buffer."""

    start: int
    end: int
    kind: str
    """The smallest encoding of the bucket's changes:

    - ``raw``: the bucket's new bytes (most words changed: fp32 on the wire, a large step);
    - ``idx``: the changed 16-bit words' indices (uint32) and their new values (6 bytes per change);
    - ``mask``: one bit per word (changed or not) and the new values (1/16 of raw + 2 bytes per
      change)."""
    data: np.ndarray
    """raw: the new bytes; idx: uint32 word indices; mask: packed bits, one per word."""
    values: np.ndarray | None = None
    """idx and mask: the new 16-bit words, in index order."""

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes + (self.values.nbytes if self.values is not None else 0))


@dataclass(frozen=True)
class Delta:
    """Version ``base`` -> ``version`` of one flat buffer of ``size`` bytes."""

    base: int
    version: int
    size: int
    checksum: int
    """CRC32 of the full buffer of ``version``: what the receiver must end up with."""
    buckets: tuple[DeltaBucket, ...]

    @property
    def nbytes(self) -> int:
        """Bytes of payload (what crosses the link, up to a few hundred bytes of framing)."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def changed_fraction(self) -> float:
        return self.nbytes / self.size if self.size else 0.0


def _encode(old: np.ndarray, new: np.ndarray, start: int, end: int) -> DeltaBucket:
    o = old[start:end].view(WORD)
    n = new[start:end].view(WORD)
    diff = o != n
    idx = np.flatnonzero(diff)
    raw_bytes = end - start
    idx_bytes = idx.size * (4 + WORD.itemsize)
    mask_bytes = (diff.size + 7) // 8 + idx.size * WORD.itemsize
    best = min(raw_bytes, idx_bytes, mask_bytes)
    if best == raw_bytes:
        return DeltaBucket(start, end, "raw", new[start:end].copy())
    values = n[idx].copy()
    if best == idx_bytes:
        return DeltaBucket(start, end, "idx", idx.astype(np.uint32), values)
    return DeltaBucket(start, end, "mask", np.packbits(diff), values)


def make_delta(old: np.ndarray, new: np.ndarray, base: int, version: int, bucket_bytes: int = 16 << 20) -> Delta:
    """The delta that turns ``old`` (version ``base``) into ``new`` (``version``): two uint8
    buffers of one layout. ``bucket_bytes`` is rounded down to whole words."""
    if old.shape != new.shape or old.dtype != np.uint8 or new.dtype != np.uint8:
        raise DeltaError(f"make_delta needs two uint8 buffers of one size, got {old.dtype}{old.shape} and "
                         f"{new.dtype}{new.shape}")
    if new.nbytes % WORD.itemsize:
        raise DeltaError(f"buffer of {new.nbytes} bytes is not a whole number of 16-bit words")
    step = max(WORD.itemsize, bucket_bytes // WORD.itemsize * WORD.itemsize)
    buckets = tuple(_encode(old, new, s, min(s + step, new.nbytes)) for s in range(0, new.nbytes, step))
    return Delta(int(base), int(version), int(new.nbytes), checksum(new), buckets)


def apply_delta(old: np.ndarray, delta: Delta, base: int) -> np.ndarray:
    """A new buffer: ``old`` (which holds version ``base``) with ``delta`` applied; checked
    against the delta's checksum. ``old`` is not modified (it may be read-only shared memory)."""
    if base != delta.base:
        raise DeltaError(f"delta {delta.base}->{delta.version} applied to version {base}")
    if old.nbytes != delta.size:
        raise DeltaError(f"delta {delta.base}->{delta.version} is for {delta.size} bytes, the buffer has {old.nbytes}")
    out = old.copy()
    for b in delta.buckets:
        if b.kind == "raw":
            out[b.start:b.end] = b.data
            continue
        words = out[b.start:b.end].view(WORD)
        if b.kind == "idx":
            words[b.data] = b.values
        elif b.kind == "mask":
            changed = np.unpackbits(b.data, count=words.size).astype(bool)
            words[changed] = b.values
        else:
            raise DeltaError(f"unknown delta bucket kind {b.kind!r}")
    got = checksum(out)
    if got != delta.checksum:
        raise DeltaError(f"delta {delta.base}->{delta.version}: checksum {got:08x} after applying, "
                         f"expected {delta.checksum:08x}")
    return out

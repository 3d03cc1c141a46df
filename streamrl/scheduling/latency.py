"""Per-token latency model PTL(BS) of a generation instance (PAPER.md §3.7).

A sample of ``L`` output tokens decoded on an instance running batch size ``BS`` takes
``PTL(BS) * L``; an instance given ``M`` prompts of mean length ``L_avg`` with at most ``BS``
running at once takes ``PTL(BS) * L_avg * ceil(M / BS)``. Dispatch (Algorithm 2) and the planner
read nothing else about an engine. ``LatencyModel`` is a table of measured points.

Profile file (written by ``streamrl profile``, read by ``load_profile``; other keys go to ``extra``)::

    {"engine": "vllm", "model": "qwen2.5-7b", "device": "H800", "kv_ms_per_token": 0.0019,
     "points": [{"batch_size": 1, "ms_per_token": 8.4}, {"batch_size": 2, "ms_per_token": 8.7}],
     "train_tokens_per_s": 12000.0}
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass(frozen=True)
class LatencyModel:
    """Measured per-token decode latency of one engine instance as a function of batch size.

    ``points`` must be non-empty with distinct positive batch sizes. Optional profile keys kept
    in ``extra``: ``train_tokens_per_s`` (trainer throughput on the same devices) and
    ``kv_ms_per_token`` (step cost per running context token)."""

    points: tuple[tuple[int, float], ...]
    """``(batch_size, ms_per_token)`` pairs, sorted by batch size."""
    engine: str = ""
    model: str = ""
    device: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False)
    """Other keys of the profile file (e.g. ``train_tokens_per_s``), passed through unchanged."""

    def __post_init__(self) -> None:
        if not self.points:
            raise ValueError("LatencyModel.points is empty: need at least one (batch_size, ms_per_token)")
        pts = tuple(sorted((int(b), float(t)) for b, t in self.points))
        for b, t in pts:
            if b < 1 or not t > 0:
                raise ValueError(f"LatencyModel point (batch_size={b}, ms_per_token={t}) must have batch_size>=1, ms>0")
        if len({b for b, _ in pts}) != len(pts):
            raise ValueError(f"LatencyModel.points has duplicate batch sizes: {pts}")
        object.__setattr__(self, "points", pts)

    @property
    def max_batch_size(self) -> int:
        """Largest measured batch size (the engine's batch limit unless told otherwise)."""
        return self.points[-1][0]

    def ms_per_token(self, batch_size: float) -> float:
        """PTL(batch_size) in milliseconds per output token of one sequence.

        Interpolated linearly in batch size between points (decode cost is close to affine in
        batch size: each extra sequence adds its KV-cache reads), clamped below the first point
        and extrapolated with the last segment's slope above the last one."""
        pts = self.points
        if batch_size <= pts[0][0] or len(pts) == 1:
            return pts[0][1]
        for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
            if batch_size <= b1:
                return t0 + (t1 - t0) * (batch_size - b0) / (b1 - b0)
        (b0, t0), (b1, t1) = pts[-2], pts[-1]
        return t1 + (t1 - t0) / (b1 - b0) * (batch_size - b1)

    def seconds_per_token(self, batch_size: float) -> float:
        return self.ms_per_token(batch_size) / 1000.0

    @property
    def kv_ms_per_token(self) -> float:
        """Extra milliseconds one decode step costs per context token (prompt + generated) held
        by the running requests; 0 when the profile has none. PTL(BS) is measured at short
        context; this is the part of a step that grows with context instead of batch size
        (on the CPU engine ~0.0019 ms: a step of 64 requests of context 230 costs 36 ms, not 9)."""
        return float(self.extra.get("kv_ms_per_token", 0.0))

    def tokens_per_s(self, batch_size: float) -> float:
        """Aggregate decode throughput of the instance at this batch size."""
        return batch_size / self.seconds_per_token(batch_size)

    def pool_latency_s(self, num_prompts: int, mean_len: float, max_batch_size: int | None = None) -> float:
        """``PTL(BS) * L_avg * ceil(M / BS)`` with ``BS = min(M, max_batch_size)``; 0 for no prompts."""
        if num_prompts <= 0:
            return 0.0
        cap = max_batch_size or self.max_batch_size
        bs = min(num_prompts, cap)
        return self.seconds_per_token(bs) * mean_len * math.ceil(num_prompts / bs)


H800_QWEN7B_VLLM = LatencyModel(
    points=((1, 8.4), (2, 8.7), (4, 8.9), (8, 9.0), (16, 9.4), (32, 10.2), (64, 11.7), (128, 15.3), (256, 21.2), (512, 36.9)),
    engine="vllm",
    model="qwen2.5-7b",
    device="H800",
)
"""PAPER.md §3.7: measured PTL of a 7B model on one H800 with vLLM (ms per token)."""


def latency_from_dict(data: dict[str, Any]) -> LatencyModel:
    """Build a model from the profile-file dict (see module docstring)."""
    try:
        raw = data["points"]
        points = tuple((int(p["batch_size"]), float(p["ms_per_token"])) for p in raw)
    except (KeyError, TypeError) as exc:
        raise ValueError(f"latency profile needs points=[{{batch_size, ms_per_token}}, ...]; got {data!r}") from exc
    extra = {k: v for k, v in data.items() if k not in ("engine", "model", "device", "points")}
    return LatencyModel(points, str(data.get("engine", "")), str(data.get("model", "")), str(data.get("device", "")), extra)


def latency_to_dict(model: LatencyModel) -> dict[str, Any]:
    return {
        "engine": model.engine,
        "model": model.model,
        "device": model.device,
        "points": [{"batch_size": b, "ms_per_token": t} for b, t in model.points],
        **model.extra,
    }


def load_profile(path: str | Path) -> LatencyModel:
    """Read a profile JSON file written by ``save_profile`` (or ``streamrl profile``)."""
    return latency_from_dict(json.loads(Path(path).read_text()))


def save_profile(model: LatencyModel, path: str | Path) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(latency_to_dict(model), indent=2) + "\n")


def from_measurements(batch_sizes: Sequence[int], ms_per_token: Sequence[float], **meta: str) -> LatencyModel:
    """Convenience for profilers: two parallel lists to a model."""
    if len(batch_sizes) != len(ms_per_token):
        raise ValueError(f"{len(batch_sizes)} batch sizes but {len(ms_per_token)} latencies")
    return LatencyModel(tuple(zip(batch_sizes, ms_per_token)), **meta)

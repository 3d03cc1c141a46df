"""``weights``: how new weights reach the generation instances (``streamrl.weights.engine``)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from streamrl.config.base import _Section


class WeightsConfig(_Section):
    """How new weights reach the generation instances (``streamrl.weights.engine``)."""

    method: Literal["naive", "tree"] = "tree"
    """naive (every instance fetches from the trainer) | tree (one copy per node and per remote site: a relay
    instance re-publishes to its site, weights.fanout at a time)"""
    fanout: int = Field(2, ge=1)
    """tree: nodes each relay feeds inside its site"""
    wire_dtype: Literal["float32", "bfloat16"] | None = None
    """dtype of floating-point weights on the wire (bfloat16 halves the bytes; instances keep their own dtype);
    None = the engines' dtype: bfloat16 on placement.device=cuda (unless generation.vllm.dtype is float32), float32
    on CPU"""
    delta: bool = False
    """send only the 16-bit words that changed since the version an instance holds (lossless, CRC-checked); a new or
    lagging instance gets a full copy"""
    bucket_mb: float = Field(16.0, gt=0)
    """delta: bytes per bucket, each encoded on its own"""


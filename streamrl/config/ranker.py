"""``ranker``: the output-length ranker, checked against the registry in ``streamrl.ranker.base``."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from streamrl.config.base import _choice, _Section


class RankerConfig(_Section):
    """Output-length ranker used by the SGS when dispatch or order needs predicted lengths."""

    name: str = "blend"
    """learned | lm (the policy fine-tuned to predict lengths) | history | blend (history + a text prior:
    kwargs.prior learned|lm) | reweighted (earlier responses scored by the current policy; kwargs.estimator) |
    prompt-length | none (equal predictions)"""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """constructor arguments of the ranker"""
    fit_file: str | None = None
    """JSONL of {key, text, length} records to fit on before the first iteration; None = cold start, fitted on the
    first finished batch"""
    refresh: bool = True
    """update from finished generations each iteration, in the background"""

    @field_validator("name")
    @classmethod
    def _known_ranker(cls, value: str) -> str:
        from streamrl.ranker.base import RANKERS  # numpy only: no torch, no Ray

        return _choice(value, [*RANKERS, "none"], "ranker")


"""streamrl: RL post-training for LLMs with disaggregated, streamed generation and training.

The Python API (names are imported lazily, so ``import streamrl`` stays cheap)::

    from streamrl import Config, load_config, train
    cfg = load_config("my.yaml", ["mode=stream-async", "run.iterations=2"])
    summary = train(cfg, reward_fn=my_reward, dataset="prompts.jsonl")

``train`` is ``streamrl train`` without the command line: see ``streamrl.api.train``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Config", "ConfigError", "load_config", "train"]

if TYPE_CHECKING:
    from streamrl.api import train
    from streamrl.config import Config, ConfigError, load_config


def __getattr__(name: str) -> Any:
    if name in ("Config", "ConfigError", "load_config"):
        import streamrl.config as config

        return getattr(config, name)
    if name == "train":
        from streamrl.api import train

        return train
    raise AttributeError(f"module 'streamrl' has no attribute {name!r}")

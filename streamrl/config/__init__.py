"""Typed run configuration: YAML presets plus dotted command-line overrides.

``load_config("configs/tiny.yaml", ["trainer.lr=3e-4", "mode=stream-sync"])`` reads the file,
applies each override (parsed as YAML, so ``3e-4``, ``true`` and ``[1, 2]`` work) and validates
the whole tree: an unknown key or bad value raises ``ConfigError`` naming the dotted key and the
value (and the closest key or name for a typo) before any work starts. Relative paths in a file
resolve against its directory, those of overrides and defaults against the working directory
(``PATH_FIELDS``). Defaults run on a 2-core laptop. One module per section (``run``, ``task``,
``generation``, ...), the cross-section checks in ``root``, files and overrides in ``loading``;
``streamrl config show`` prints the resolved config (``dump_config_annotated``).
"""

from streamrl.config.base import ConfigError, _model_in
from streamrl.config.cluster import ClusterConfig
from streamrl.config.generation import GenerationConfig
from streamrl.config.loading import (
    PATH_FIELDS,
    config_from_dict,
    dump_config,
    dump_config_annotated,
    load_cli_config,
    load_config,
    parse_override,
    plan_overrides,
    split_cli_config,
)
from streamrl.config.logs import LOGGING_BACKENDS, LoggingConfig
from streamrl.config.placement import NodeGroupConfig, PlacementConfig
from streamrl.config.policy import PolicyConfig
from streamrl.config.ranker import RankerConfig
from streamrl.config.root import Config
from streamrl.config.run import RunConfig
from streamrl.config.task import TaskConfig, is_reward_file, reward_specs
from streamrl.config.trainer import LoraConfig, TrainerConfig
from streamrl.config.weights import WeightsConfig

__all__ = [
    "LOGGING_BACKENDS", "PATH_FIELDS", "ClusterConfig", "Config", "ConfigError", "GenerationConfig", "LoggingConfig",
    "LoraConfig", "NodeGroupConfig", "PlacementConfig", "PolicyConfig", "RankerConfig", "RunConfig", "TaskConfig", "TrainerConfig",
    "WeightsConfig", "_model_in", "config_from_dict", "dump_config", "dump_config_annotated", "is_reward_file",
    "load_cli_config", "load_config", "parse_override", "plan_overrides", "reward_specs", "split_cli_config",
]

"""EngineConfig and its sub-configs (pydantic v2).

Every field is settable from keyword arguments, a config file and CLI flags; see docs/config.md.
`load_config` merges those sources (defaults < kwargs < file < flags unless told otherwise), lets
plugins' `llmplug_adjust_config` hooks adjust the result and validates it once, naming the field,
value and source of every error. Aliases and flag names are generated from the schema.

One module per job: `schema` (the sections and their fields), `keys` (dotted paths, aliases, flags),
`loading` (sources, hooks, validation), `files` (YAML/TOML/JSON), `output` (`llmplug config`).
"""

from llmplug.core.config.files import read_config_file
from llmplug.core.config.keys import ALIASES, FIELD_FLAGS, FIELD_PATHS, FLAG_PATHS, SECTIONS, is_bool_field
from llmplug.core.config.loading import HOOK_SOURCE, SOURCE_ORDER, ResolvedConfig, load_config
from llmplug.core.config.output import CONFIG_FORMATS, format_config
from llmplug.core.config.schema import (
    DEFAULT_MODEL,
    BoolOrAuto,
    CacheConfig,
    DecodingConfig,
    DeviceConfig,
    EngineConfig,
    KVTransferConfig,
    LoadConfig,
    LoRAConfig,
    ModelConfig,
    ParallelConfig,
    PluginConfig,
    PoolerConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

__all__ = [
    "ALIASES",
    "CONFIG_FORMATS",
    "DEFAULT_MODEL",
    "FIELD_FLAGS",
    "FIELD_PATHS",
    "FLAG_PATHS",
    "HOOK_SOURCE",
    "SECTIONS",
    "SOURCE_ORDER",
    "BoolOrAuto",
    "CacheConfig",
    "DecodingConfig",
    "DeviceConfig",
    "EngineConfig",
    "KVTransferConfig",
    "LoRAConfig",
    "LoadConfig",
    "ModelConfig",
    "ParallelConfig",
    "PluginConfig",
    "PoolerConfig",
    "ResolvedConfig",
    "SchedulerConfig",
    "SpeculativeConfig",
    "format_config",
    "is_bool_field",
    "load_config",
    "read_config_file",
]

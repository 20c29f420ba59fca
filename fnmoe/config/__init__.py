"""Run configuration: frozen dataclasses, TOML presets and validation (docs/design.md §3).

A `RunConfig` is the whole run; `forward` and `hf` take only its `ModelConfig`. Presets are
TOML files whose tables mirror the dataclass tree; `load_config` reads one and validates it.

  ranges.py   Range (a number field's bounds) and the bounded types the fields use
  model.py    ModelConfig and MoEConfig, the model's shape (what forward and hf take), and Dtype
  schema.py   the run's other dataclasses and RunConfig (fields, defaults, help, derived properties)
  types.py    each field's own check from its annotation: type, choices, range, finiteness
  check.py    validate_model, validate: every problem at once, by field name
  toml.py     read_toml, from_dict, drop_unknown, to_dict, to_toml, load_config

Modules import one way, in that order; this file only re-exports.
"""
from fnmoe.config.check import validate, validate_model
from fnmoe.config.model import Dtype, ModelConfig, MoEConfig
from fnmoe.config.schema import (
    CheckpointConfig,
    DataConfig,
    DistConfig,
    MemoryConfig,
    MeshConfig,
    MixSource,
    REGIONS,
    OptimConfig,
    PlanConfig,
    ProfileConfig,
    RegionPolicy,
    RunConfig,
    TrainConfig,
)
from fnmoe.config.toml import (config_from_tables, drop_unknown, from_dict, load_config, read_toml, to_dict, to_toml,
                               with_token_steps)

__all__ = [
    "CheckpointConfig", "DataConfig", "DistConfig", "Dtype", "MemoryConfig", "MeshConfig", "MixSource", "ModelConfig",
    "MoEConfig", "OptimConfig", "PlanConfig", "ProfileConfig", "REGIONS", "RegionPolicy", "RunConfig", "TrainConfig",
    "config_from_tables", "drop_unknown", "from_dict", "load_config", "read_toml", "to_dict", "to_toml", "validate",
    "validate_model", "with_token_steps",
]

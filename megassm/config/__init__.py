"""Run configuration: YAML file -> typed dataclasses, dotted overrides, validation before any compute.

    cfg = load_config("configs/tiny.yaml", ["model.d_model=256", "train.steps=50"])

Unknown keys are errors that name the key, the file (or "command line") and the closest valid key.
`validate(cfg)` runs the cross-checks (heads and groups divide, batch triad, pattern letters) and is
called by `load_config`, so a mistake fails before a model is built or a GPU is touched.

    sections.py   the dataclasses, one per YAML section, with their defaults (docs/config.md)
    parse.py      YAML text / mappings / overrides -> Config, and back (load_config, dump_config)
    checks.py     validate: the cross-checks
    derived.py    sizes the config implies (blocks_of, mamba_dims, world_size, ...)
"""
from .sections import (
    ConfigError, MambaConfig, AttentionConfig, MLPConfig, CoffeeConfig, BMojoConfig, Mamba1Config, LonghornConfig,
    ModelConfig, TrainConfig, OptimConfig, DataConfig, ParallelConfig, RunConfig, KernelsConfig, Config,
    PATTERN_SEPARATORS, MLP_ACTIVATIONS, block_letters,
)
from .derived import (
    blocks_of, mamba_dims, scan_dims, ffn_hidden, attn_dims, world_size, data_parallel_size,
)
from .checks import (
    in_run_dir, validate,
)
from .parse import (
    DEPRECATED_KEYS, all_keys, parse_override, load_config, config_from_text, config_from_dict, config_to_dict,
    dump_config,
)

__all__ = [
    "ConfigError", "MambaConfig", "AttentionConfig", "MLPConfig", "CoffeeConfig", "BMojoConfig", "Mamba1Config",
    "LonghornConfig", "ModelConfig", "TrainConfig", "OptimConfig", "DataConfig", "ParallelConfig", "RunConfig",
    "KernelsConfig", "Config", "PATTERN_SEPARATORS", "MLP_ACTIVATIONS", "block_letters", "blocks_of",
    "mamba_dims", "scan_dims", "ffn_hidden", "attn_dims", "world_size", "data_parallel_size", "in_run_dir",
    "validate", "DEPRECATED_KEYS", "all_keys", "parse_override", "load_config", "config_from_text", "config_from_dict",
    "config_to_dict", "dump_config",
]

"""Job configuration: pydantic schema, YAML loading, dotted overrides, clear errors."""

from .loader import ConfigError, apply_overrides, build_config, config_hash, explain, load_config, to_yaml
from .schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "build_config", "config_hash", "explain",
           "load_config", "to_yaml"]

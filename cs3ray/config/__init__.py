"""Job configuration: pydantic schema, YAML loading, dotted overrides, clear errors."""

from .loader import (
                     ConfigError,
                     apply_overrides,
                     build_config,
                     config_hash,
                     explain,
                     load_config,
                     redact_config_text,
                     runtime_serve_options,
                     runtime_storage_options,
                     stored_config,
                     to_yaml,
)
from .redact import redact_config, redact_options
from .runs import open_run, resolve_run, run_dir
from .schema import JobConfig

__all__ = ["ConfigError", "JobConfig", "apply_overrides", "build_config", "config_hash", "explain",
           "load_config", "open_run", "redact_config", "redact_config_text", "redact_options", "resolve_run",
           "run_dir", "runtime_serve_options", "runtime_storage_options", "stored_config", "to_yaml"]

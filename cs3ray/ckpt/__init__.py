"""Checkpoints: tiered (memory, storage, replicas), incremental chunks, manifests and checksums.

The names below load their modules on first use (PEP 562): the keeper actors of the memory
tier import `cs3ray.ckpt.keeper`, and a process that only keeps chunks must not pay for
importing torch and DCP (seconds of CPU per keeper on a small host, on every cluster start).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_WHERE = {"LoadedModel": "inference", "load_for_inference": "inference", "resolve_checkpoint": "inference",
          "resolve_run": "inference", "list_steps": "locations", "step_dir": "locations",
          "CheckpointManager": "manager", "Restored": "manager", "CheckpointError": "manifest",
          "read_manifest": "manifest", "verify": "manifest"}
__all__ = ["CheckpointError", "CheckpointManager", "LoadedModel", "Restored", "list_steps", "load_for_inference",
           "read_manifest", "resolve_checkpoint", "resolve_run", "step_dir", "verify"]

if TYPE_CHECKING:
    from .inference import LoadedModel, load_for_inference, resolve_checkpoint, resolve_run
    from .locations import list_steps, step_dir
    from .manager import CheckpointManager, Restored
    from .manifest import CheckpointError, read_manifest, verify


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)

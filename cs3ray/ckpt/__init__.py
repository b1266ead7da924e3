"""Checkpoints: tiered (memory, storage, replicas), incremental chunks, manifests and checksums."""

from .inference import LoadedModel, load_for_inference, resolve_checkpoint, resolve_run
from .locations import list_steps, step_dir
from .manager import CheckpointManager, Restored
from .manifest import CheckpointError, read_manifest, verify

__all__ = ["CheckpointError", "CheckpointManager", "LoadedModel", "Restored", "list_steps", "load_for_inference",
           "read_manifest", "resolve_checkpoint", "resolve_run", "step_dir", "verify"]

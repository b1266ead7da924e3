"""Checkpoints: sharded DCP state with manifests and checksums, and loading for inference."""

from .inference import LoadedModel, load_for_inference, resolve_checkpoint, resolve_run
from .manager import CheckpointManager, list_steps, step_dir
from .manifest import CheckpointError, read_manifest, verify

__all__ = ["CheckpointError", "CheckpointManager", "LoadedModel", "list_steps", "load_for_inference",
           "read_manifest", "resolve_checkpoint", "resolve_run", "step_dir", "verify"]

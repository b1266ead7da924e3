"""Checkpoints: tiered (memory, storage, replicas), incremental chunks, manifests and checksums.

The memory tier's keeper actors run cs3ray.keeper, outside this package, so that a process that
only keeps chunks never imports torch and DCP.
"""

from .catalog import list_checkpoints, resolve_target, verify_checkpoints
from .inference import LoadedModel, load_for_inference, resolve_checkpoint
from .locations import list_steps, step_dir
from .manager import CheckpointManager, Restored
from .manifest import CheckpointError, read_manifest, verify
from .reading import open_checkpoint
from .restore import Checkpoint

__all__ = ["Checkpoint", "CheckpointError", "CheckpointManager", "LoadedModel", "Restored", "list_checkpoints",
           "list_steps", "load_for_inference", "open_checkpoint", "read_manifest", "resolve_checkpoint",
           "resolve_target", "step_dir", "verify", "verify_checkpoints"]

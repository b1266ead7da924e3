"""Ray Train glue: the driver that starts a run and the loop each worker actor runs."""

from .driver import TrainingError, prepare_data, train

__all__ = ["TrainingError", "prepare_data", "train"]

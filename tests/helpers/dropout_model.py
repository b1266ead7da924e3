"""A user model factory for tests: the tiny transformer with dropout on its logits.

`model.target=tests.helpers.dropout_model:build` works on the workers because Ray puts the driver's
working directory (the repository root) on their path, as it does for a user's own module.

Dropout draws from the training RNG on every step, so two runs only agree step for step when
a resume continues the saved random streams.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cs3ray.config.schema import ModelConfig
from cs3ray.models import Transformer


class DropoutTransformer(Transformer):
    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        return F.dropout(super().forward(tokens, cache), p=0.2, training=self.training)


def build(section: dict) -> Transformer:
    """The model section (a dict) -> the preset's transformer with dropout on its logits."""
    fields = {k: v for k, v in section.items() if k != "target"}
    return DropoutTransformer(ModelConfig(**fields).args())

"""A user model factory for tests: the tiny transformer, whose every forward also waits 20 ms.

A step then takes at least that long on any host, so a test can count on time passing between
steps (checkpoint.every_minutes) without knowing how fast the machine is.
"""

from __future__ import annotations

import time

import torch

from cs3ray.config.schema import ModelConfig
from cs3ray.models import Transformer

FORWARD_S = 0.02


class SlowTransformer(Transformer):
    def forward(self, tokens: torch.Tensor, cache=None) -> torch.Tensor:
        time.sleep(FORWARD_S)
        return super().forward(tokens, cache)


def build(section: dict) -> Transformer:
    """The model section (a dict) -> the preset's transformer, 20 ms slower a forward."""
    fields = {k: v for k, v in section.items() if k != "target"}
    return SlowTransformer(ModelConfig(**fields).args())

"""The shape of a model, without torch: configs, plans and presets read it where no model is built."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class ModelArgs:
    """The shape of a model; everything needed to rebuild it from a checkpoint."""

    dim: int = 192
    n_layers: int = 4
    n_heads: int = 6
    n_kv_heads: int | None = None
    ffn_dim: int = 512
    vocab_size: int = 264
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = True

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict:
        return asdict(self)

"""A byte-level tokenizer: every UTF-8 byte is a token, plus a few specials. No downloads."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class ByteTokenizer:
    """Ids 0..255 are bytes; BOS, EOS and PAD follow. Decoding never fails (bad UTF-8 is replaced)."""

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258

    @property
    def vocab_size(self) -> int:
        return 259

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = list(text.encode("utf-8"))
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def to_json(self) -> str:
        """What a checkpoint stores so it describes its own tokenizer."""
        return json.dumps({"type": "byte", "bos_id": self.bos_id, "eos_id": self.eos_id,
                           "pad_id": self.pad_id, "vocab_size": self.vocab_size})

    @classmethod
    def from_json(cls, text: str) -> "ByteTokenizer":
        spec = json.loads(text)
        if spec.get("type") != "byte":
            raise ValueError(f"unknown tokenizer type {spec.get('type')!r}; cs3ray knows only 'byte'")
        return cls(bos_id=spec["bos_id"], eos_id=spec["eos_id"], pad_id=spec["pad_id"])

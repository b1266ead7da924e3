"""A byte-level tokenizer: every UTF-8 byte is a token, plus a few specials. No downloads."""

from __future__ import annotations

import json
from dataclasses import dataclass

from cs3ray.errors import UserError


class TokenizerError(UserError):
    """A tokenizer cannot be loaded or does not fit the data, model or checkpoint; the message names both."""


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

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many documents."""
        return [list(t.encode("utf-8")) for t in texts]

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (empty for specials): what UTF-8-safe streaming decodes."""
        return [bytes([i]) for i in range(256)] + [b""] * (self.vocab_size - 256)

    def describe(self) -> str:
        """A short name for messages."""
        return "byte"

    def to_json(self) -> str:
        """What a checkpoint stores so it describes its own tokenizer."""
        return json.dumps({"type": "byte", "bos_id": self.bos_id, "eos_id": self.eos_id,
                           "pad_id": self.pad_id, "vocab_size": self.vocab_size})

    @classmethod
    def from_json(cls, text: str) -> "ByteTokenizer":
        spec = json.loads(text)
        if spec.get("type") != "byte":
            raise TokenizerError(f"tokenizer type {spec.get('type')!r} is not 'byte'")
        return cls(bos_id=spec["bos_id"], eos_id=spec["eos_id"], pad_id=spec["pad_id"])

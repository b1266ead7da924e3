"""Byte-level BPE tokenizers of Hugging Face `tokenizers`: trained locally, stored as JSON (data, never code)."""

from __future__ import annotations

import hashlib
import json
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from .tokenizer import TokenizerError

# The specials a trained tokenizer gets, as ids 0, 1, 2 (before the 256 byte symbols).
EOS, BOS, PAD = "<|endoftext|>", "<|bos|>", "<|pad|>"
# Names under which tokenizers trained elsewhere keep the same specials.
EOS_NAMES = (EOS, "</s>", "<|eos|>", "<eos>", "<|end_of_text|>")
BOS_NAMES = (BOS, "<s>", "<|begin_of_text|>", "<bos>")
PAD_NAMES = (PAD, "<pad>")
MIN_VOCAB = 259  # 256 byte symbols and the three specials


def _unicode_to_byte() -> dict[str, int]:
    """The inverse of the byte-level alphabet (GPT-2's bytes_to_unicode): a symbol -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: b for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = 256 + extra, extra + 1
    return {chr(c): b for b, c in chars.items()}


def byte_symbols() -> list[str]:
    """The symbol byte-level BPE writes for each byte 0..255 (GPT-2's bytes_to_unicode), in byte order."""
    return [ch for ch, _ in sorted(_unicode_to_byte().items(), key=lambda kv: kv[1])]


class BPETokenizer:
    """A byte-level BPE of Hugging Face `tokenizers`, with the interface of ByteTokenizer."""

    def __init__(self, hf_json: str, source: str = "tokenizer") -> None:
        try:
            spec = json.loads(hf_json)
            self._tok = Tokenizer.from_str(hf_json)
        except Exception as exc:  # noqa: BLE001 - the library raises plain Exceptions for bad JSON
            raise TokenizerError(f"{source} is not a valid Hugging Face tokenizer JSON ({str(exc)[:120]}).") from None
        model = (spec.get("model") or {}).get("type")
        decoder = (spec.get("decoder") or {}).get("type")
        if model != "BPE" or decoder != "ByteLevel":
            raise TokenizerError(f"{source} is a {model or 'unknown'} tokenizer with a {decoder or 'missing'} decoder; "
                                 f"cs3ray uses byte-level BPE tokenizers only (train one with `cs3 data tokenizer`).")
        # Canonical text: the same tokenizer always has the same fingerprint, however it was formatted.
        self.hf_json = json.dumps(spec, sort_keys=True, separators=(",", ":"))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        eos = self._find(EOS_NAMES)
        if eos is None:
            raise TokenizerError(f"{source} has no end-of-text token (one of {', '.join(EOS_NAMES)}).")
        self.eos_id = eos
        self.bos_id = self._find(BOS_NAMES, eos)
        self.pad_id = self._find(PAD_NAMES, eos)
        specials = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        to_byte = _unicode_to_byte()
        table: list[bytes] = []
        for i in range(self.vocab_size):
            piece = self._tok.id_to_token(i)
            if piece is None or i in specials:
                table.append(b"")
            elif all(c in to_byte for c in piece):
                table.append(bytes(to_byte[c] for c in piece))
            else:
                table.append(piece.encode("utf-8"))
        self._bytes = table

    def _find(self, names: tuple[str, ...], default: int | None = None) -> int | None:
        return next((i for i in (self._tok.token_to_id(n) for n in names) if i is not None), default)

    def encode(self, text: str, bos: bool = False, eos: bool = False) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many documents at once (on all cores)."""
        return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`; specials and ids beyond the vocabulary carry none, bad UTF-8 is replaced."""
        return b"".join(self._bytes[i] for i in ids if 0 <= i < self.vocab_size).decode("utf-8", errors="replace")

    def token_bytes(self) -> list[bytes]:
        """The bytes each id stands for (empty for specials): what UTF-8-safe streaming decodes."""
        return list(self._bytes)

    def to_json(self) -> str:
        """What a checkpoint or shard manifest stores: type, specials and the Hugging Face JSON itself."""
        return json.dumps({"type": "bpe", "bos_id": self.bos_id, "eos_id": self.eos_id, "pad_id": self.pad_id,
                           "vocab_size": self.vocab_size, "hf": json.loads(self.hf_json)})

    def hf_text(self) -> str:
        """The plain Hugging Face tokenizer.json (loadable by `tokenizers` and transformers)."""
        return self._tok.to_str(pretty=True)

    def describe(self) -> str:
        """A short name for messages: type, size and fingerprint."""
        return f"bpe (vocab {self.vocab_size}, {hashlib.sha256(self.hf_json.encode()).hexdigest()[:12]})"


def train_bpe(texts: Iterable[str], vocab_size: int) -> BPETokenizer:
    """Train a byte-level BPE of `vocab_size` ids (specials included) on `texts`; no network."""
    if vocab_size < MIN_VOCAB:
        raise TokenizerError(f"a byte-level BPE needs a vocabulary of at least {MIN_VOCAB} (256 bytes and 3 "
                             f"specials), not {vocab_size}.")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS, BOS, PAD], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return BPETokenizer(tok.to_str(), source="the trained tokenizer")

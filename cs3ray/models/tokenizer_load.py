"""Which tokenizer: 'byte', a local tokenizer.json (or a folder holding one), or a stored self-describing JSON."""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path
from typing import Union

from .bpe import BPETokenizer
from .tokenizer import ByteTokenizer, TokenizerError

Tokenizer = Union[ByteTokenizer, BPETokenizer]
BYTE = "byte"
MAX_VOCAB = 1 << 16  # shards store token ids as uint16


def tokenizer_from_json(text: str, source: str = "tokenizer.json") -> Tokenizer:
    """A tokenizer from what a checkpoint or shard manifest stores (`type: byte|bpe`)."""
    try:
        spec = json.loads(text)
    except ValueError:
        raise TokenizerError(f"{source} is not valid JSON.") from None
    kind = spec.get("type") if isinstance(spec, dict) else None
    if kind == "byte":
        try:
            return ByteTokenizer(bos_id=int(spec["bos_id"]), eos_id=int(spec["eos_id"]), pad_id=int(spec["pad_id"]))
        except (KeyError, TypeError, ValueError):
            raise TokenizerError(f"{source} is a byte tokenizer without valid bos_id, eos_id and pad_id.") from None
    if kind == "bpe" and isinstance(spec.get("hf"), dict):
        return BPETokenizer(json.dumps(spec["hf"]), source=source)
    raise TokenizerError(f"{source} has tokenizer type {kind!r}; cs3ray knows 'byte' and 'bpe'.")


def load_tokenizer(name: str) -> Tokenizer:
    """data.tokenizer: 'byte', or a local tokenizer.json / folder holding one (Hugging Face or cs3ray JSON)."""
    if name == BYTE:
        return ByteTokenizer()
    path = Path(name).expanduser()
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise TokenizerError(f"data.tokenizer '{name}' is neither 'byte' nor a tokenizer.json file or a folder "
                             f"holding one.")
    stat = path.stat()
    return _load_file(str(path), stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=8)
def _load_file(name: str, mtime_ns: int, size: int) -> Tokenizer:
    # Every config validation resolves data.tokenizer: parse a file once until it changes.
    path = Path(name)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"cannot read tokenizer '{path}': {exc}") from None
    try:
        stored = json.loads(text).get("type") in ("byte", "bpe")
    except (ValueError, AttributeError):
        raise TokenizerError(f"tokenizer '{path}' is not a JSON object.") from None
    tok = tokenizer_from_json(text, str(path)) if stored else BPETokenizer(text, source=f"tokenizer '{path}'")
    if tok.vocab_size > MAX_VOCAB:
        raise TokenizerError(f"tokenizer '{path}' has {tok.vocab_size} ids; shards store ids as uint16, so at most "
                             f"{MAX_VOCAB}.")
    return tok


def padded_vocab(tok: Tokenizer) -> int:
    """The model vocabulary a tokenizer needs: its size rounded up to a multiple of 8 (matmul-friendly)."""
    return -(-tok.vocab_size // 8) * 8


def fingerprint(tok: Tokenizer) -> str:
    """Identity of a tokenizer: equal for the same ids whichever file or checkpoint it came from."""
    return hashlib.sha256(json.dumps(json.loads(tok.to_json()), sort_keys=True).encode()).hexdigest()


def check_same(stored: Tokenizer, wanted: Tokenizer, stored_where: str, wanted_where: str = "the config",
               fix: str = "use the same data.tokenizer, or new shards / a new run") -> None:
    """Refuse a tokenizer that differs from the one data or weights were made with, naming both."""
    if fingerprint(stored) != fingerprint(wanted):
        raise TokenizerError(f"{stored_where} was made with tokenizer {stored.describe()}, but {wanted_where} names "
                             f"{wanted.describe()}: {fix}.")

"""Training a byte-level BPE tokenizer on a corpus (what `cs3 data tokenizer` calls); no network."""

from __future__ import annotations

from typing import Any, Callable

from cs3ray.models import TokenizerError, train_bpe
from cs3ray.models.tokenizer_load import MAX_VOCAB
from cs3ray.storage import open_url

from .corpus import open_corpus

TOKENIZER_FILE = "tokenizer.json"


def train_tokenizer(source: str, vocab_size: int, out: str, fmt: str = "auto", text_column: str = "text",
                    max_bytes: int = 32_000_000, options: dict[str, Any] | None = None,
                    progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Train a byte-level BPE of `vocab_size` ids on up to `max_bytes` of `source` and write
    `out`/tokenizer.json (Hugging Face format, usable as data.tokenizer); returns a summary."""
    if vocab_size > MAX_VOCAB:
        raise TokenizerError(f"--vocab {vocab_size} is above {MAX_VOCAB}: shards store token ids as uint16.")
    corpus = open_corpus(source, fmt, text_column, options)
    seen = [0, 0]

    def texts():
        for text in corpus.documents(max_bytes):
            seen[0], seen[1] = seen[0] + len(text), seen[1] + 1
            if progress:
                progress(len(text))
            yield text

    tok = train_bpe(texts(), vocab_size)
    dest = open_url(out, options)
    dest.write_text(tok.hf_text(), TOKENIZER_FILE)
    return {"path": dest.path(TOKENIZER_FILE), "vocab_size": tok.vocab_size, "documents": seen[1],
            "bytes": seen[0], "tokenizer": tok.describe()}

"""Corpus pieces: a file's parts hold its bytes once each, in order, whatever the piece size; text is cut only
where a byte-level BPE encodes the parts as the whole; parquet parts share the row groups."""

from __future__ import annotations

import random

import pyarrow as pa
import pyarrow.parquet as pq

from cs3ray.data.corpus import open_corpus
from cs3ray.data.prepare import _splits_text
from cs3ray.models import ByteTokenizer, train_bpe


def test_pieces_hold_every_byte_once_in_order(tmp_path):
    rng = random.Random(0)
    for trial in range(50):
        data = bytes(rng.choice(b"ab \n\n{}x\t\xc3\xa9") for _ in range(rng.randint(0, 300)))
        for ext in ("txt", "jsonl"):
            path = tmp_path / f"f{trial}.{ext}"
            path.write_bytes(data)
            corpus = open_corpus(str(path))
            for size in (1, 2, 7, 50, 1000):
                parts = [corpus.piece_bytes(p) for p in corpus.pieces(0, size, split_text=True)]
                assert b"".join(parts) == data, (ext, size, data)
                # every part but the first starts after a newline (in text, between visible ASCII bytes)
                assert all(not p or p[0] != 0x20 for p in parts[1:] if ext == "txt")


def test_text_parts_encode_as_the_whole(tmp_path):
    text = "".join(f"{'  ' if i % 2 else ''}def f{i}(x): return x + {i}  # élan;\n{'' if i % 5 else chr(10)}"
                   for i in range(200))
    (tmp_path / "a.txt").write_text(text)
    corpus = open_corpus(str(tmp_path / "a.txt"))
    tok = train_bpe([text], 400)
    assert _splits_text(tok) and _splits_text(ByteTokenizer())
    parts = [corpus.piece_bytes(p).decode() for p in corpus.pieces(0, 300, split_text=True)]
    assert len([p for p in parts if p]) > 10 and "".join(parts) == text
    assert sum((tok.encode(p) for p in parts), []) == tok.encode(text)
    assert len(corpus.pieces(0, 300, split_text=False)) == 1


def test_parquet_parts_share_the_row_groups(tmp_path):
    values = [f"row {i}" if i % 4 else None for i in range(100)]
    pq.write_table(pa.table({"text": values}), tmp_path / "a.parquet", row_group_size=7)
    corpus = open_corpus(str(tmp_path / "a.parquet"))
    for size in (10, 100, 10**6):
        docs = [d for p in corpus.pieces(0, size, split_text=False) for d in corpus.parquet_documents(p)]
        assert docs == [v for v in values if v is not None]

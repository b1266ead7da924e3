"""Preparation that scales out: big text, JSONL and parquet files read in pieces by many tasks write the bytes
the single process writes (manifest included) at any parallelism and piece size, the staging area is gone
after, a bad JSONL line in a later piece is named by its line in the file, and the driver's memory stays far
below the corpus' tokens."""

from __future__ import annotations

import dataclasses
import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cs3ray.data import DataError, ShardSpec, open_corpus, prepare_shards, prepare_shards_ray
from cs3ray.models import train_bpe
from cs3ray.storage import open_url

SPEC = ShardSpec(seq_len=16, samples_per_shard=32, val_fraction=0.1, max_bytes=10**6, seed=5)
WORDS = ["ray", "data", "shard", "token", "packing", "order", "cluster", "node", "élan", "数据", "x=1;", "(y)"]


def _corpus(root, bad_line: bool = False) -> str:
    """Files big enough to be cut in many pieces: code-like text (indented lines are no cut), JSONL with blank
    lines and CRLF ends, parquet of many row groups with nulls; a text file not UTF-8 past its first cuts, an
    empty one, and a last JSONL file (`bad_line`: whose 61st line, after several pieces, is not JSON)."""
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(1)
    words = lambda n: " ".join(rng.choice(WORDS, n))  # noqa: E731
    (src / "a.txt").write_text("".join(f"{'    ' if i % 3 else ''}{words(6)}\n" for i in range(300)))
    (src / "b.txt").write_bytes(b"fine line\n" * 80 + b"\xff\xfe bad\n" + b"more\n" * 20)  # skipped whole
    (src / "c.txt").write_text("")
    (src / "d.jsonl").write_bytes(b"".join(
        (b"\n" if i % 7 == 0 else b"") + json.dumps({"text": words(8)}).encode() + (b"\r\n" if i % 5 else b"\n")
        for i in range(200)))
    values = [None if i % 9 == 0 else words(5) for i in range(300)]
    pq.write_table(pa.table({"text": values, "n": list(range(300))}), src / "e.parquet", row_group_size=25)
    (src / "f.jsonl").write_text("".join(json.dumps({"text": words(4)}) + "\n" for _ in range(60)) + ("{bad\n" if bad_line else ""))
    return str(src)


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_pieces_write_what_one_process_writes(ray_client, tmp_path):
    src = _corpus(tmp_path)
    corpus = open_corpus(src)
    tok = train_bpe([" ".join(WORDS)] * 20, 300)
    prepare_shards(corpus, open_url(str(tmp_path / "single")), SPEC, tokenizer=tok)
    expected = _files(tmp_path / "single")
    assert len(expected) > 8
    for parallelism, piece_bytes in ((3, 211), (2, 1500)):
        out = tmp_path / f"p{parallelism}"
        result = prepare_shards_ray(corpus, open_url(str(out)), SPEC, tokenizer=tok, parallelism=parallelism,
                                    piece_bytes=piece_bytes)
        assert _files(out) == expected  # no staging area left, every shard and the manifest the same bytes
        assert result.kept == 0 and result.driver_peak_rss_mb > 0
    # A cut inside the JSONL file (in a piece of its middle) and the byte tokenizer: the same again.
    cut = dataclasses.replace(SPEC, max_bytes=corpus.files[0].size + 4000)
    prepare_shards(corpus, open_url(str(tmp_path / "single-cut")), cut)
    prepare_shards_ray(corpus, open_url(str(tmp_path / "cut")), cut, parallelism=3, piece_bytes=333)
    assert _files(tmp_path / "cut") == _files(tmp_path / "single-cut")


def test_a_bad_line_in_a_later_piece_is_named_by_its_line_in_the_file(ray_client, tmp_path):
    corpus = open_corpus(_corpus(tmp_path, bad_line=True))
    with pytest.raises(DataError) as single:
        prepare_shards(corpus, open_url(str(tmp_path / "single")), SPEC)
    with pytest.raises(DataError) as scaled:
        prepare_shards_ray(corpus, open_url(str(tmp_path / "out")), SPEC, parallelism=2, piece_bytes=300)
    assert str(scaled.value) == str(single.value) and str(single.value).endswith("f.jsonl' line 61 is not valid JSON.")
    assert not (tmp_path / "out" / ".cs3-staging").exists()


def test_driver_memory_stays_flat_on_a_corpus_ten_times_its_bound(ray_client, tmp_path):
    # 16 MiB of text is 32 MiB of uint16 tokens; the driver may grow by a tenth of that (it grows by about
    # 1.3 MiB, the same for 4 or 32 MiB of text: Ray Data's own bookkeeping). A warm-up preparation first, so
    # what Ray Data imports and caches on its first use is not counted.
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    line = " ".join(rng.choice(WORDS[:8], 12)) + "\n"
    for i in range(32):
        (src / f"{i:02d}.txt").write_text(line * ((1 << 19) // len(line)))
    corpus = open_corpus(str(src))
    spec = ShardSpec(seq_len=128, samples_per_shard=2048, val_fraction=0.02, max_bytes=1 << 30, seed=0)
    token_bytes = 2 * sum(f.size for f in corpus.files)
    prepare_shards_ray(dataclasses.replace(corpus, files=corpus.files[:1]), open_url(str(tmp_path / "warm")), spec,
                       parallelism=2)
    bound = token_bytes // 10
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        result = prepare_shards_ray(corpus, open_url(str(tmp_path / "out")), spec, parallelism=2,
                                    piece_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()
    assert result.manifest["tokens"] > 0.99 * token_bytes / 2
    assert peak < bound, f"driver grew by {peak / 2**20:.1f} MiB preparing {token_bytes / 2**20:.0f} MiB of tokens"

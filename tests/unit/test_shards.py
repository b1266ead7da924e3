"""Corpus -> shards: sizes, split, manifest checksums, sources, clear errors."""

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cs3ray.data import DataError, ShardSpec, ensure_shards, open_corpus, prepare_shards, read_manifest, read_split
from cs3ray.data.shards import verify_shard
from cs3ray.storage import open_url

SPEC = ShardSpec(seq_len=16, samples_per_shard=10, val_fraction=0.1, max_bytes=1_000_000, seed=0)


def _text_dir(tmp_path, n=20):
    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    for i in range(n):  # random letters: no two 17-token windows coincide
        (src / f"f{i:02d}.txt").write_text("".join(chr(c) for c in rng.integers(97, 123, 400)))
    (src / "binary.txt").write_bytes(b"\xff\xfe\x00" * 10)  # skipped: not UTF-8
    return src


def test_shards_hold_every_token_once_split_and_checksummed(tmp_path):
    src = _text_dir(tmp_path)
    dest = open_url(str(tmp_path / "out"))
    m = prepare_shards(open_corpus(str(src)), dest, SPEC)
    total = m["samples"]["train"] + m["samples"]["val"]
    assert m["tokens"] == total * 17
    assert m["samples"]["val"] == round(total * 0.1)
    assert all(e["samples"] <= 10 for e in m["splits"]["train"])
    train, val = read_split(dest, m, "train"), read_split(dest, m, "val")
    assert train.shape[1] == 17 and len(train) + len(val) == total
    # the split is a partition: no sample in both
    assert not {r.tobytes() for r in train} & {r.tobytes() for r in val}
    assert read_manifest(dest) == m


def test_corrupt_shard_is_detected(tmp_path):
    dest = open_url(str(tmp_path / "out"))
    m = prepare_shards(open_corpus(str(_text_dir(tmp_path))), dest, SPEC)
    entry = m["splits"]["val"][0]
    data = bytearray(dest.read_bytes(entry["file"]))
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(DataError, match="checksum"):
        verify_shard(bytes(data), entry, entry["file"])
    dest.write_bytes(bytes(data), entry["file"])
    with pytest.raises(DataError, match="checksum"):
        read_split(dest, m, "val")


def test_jsonl_and_parquet_sources(tmp_path):
    (tmp_path / "j").mkdir()
    with open(tmp_path / "j" / "a.jsonl", "w") as f:
        for i in range(50):
            f.write(json.dumps({"text": f"row {i} " * 10}) + "\n")
    m = prepare_shards(open_corpus(str(tmp_path / "j")), open_url(str(tmp_path / "o1")), SPEC)
    assert m["samples"]["train"] > 0
    (tmp_path / "p").mkdir()
    pq.write_table(pa.table({"body": [f"para {i} " * 10 for i in range(50)]}), tmp_path / "p" / "a.parquet")
    with pytest.raises(DataError, match="no column 'text'"):
        prepare_shards(open_corpus(str(tmp_path / "p")), open_url(str(tmp_path / "o2")), SPEC)
    m = prepare_shards(open_corpus(str(tmp_path / "p"), text_column="body"), open_url(str(tmp_path / "o3")), SPEC)
    assert m["samples"]["train"] > 0


def test_bad_sources_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        open_corpus(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no readable"):
        open_corpus(str(tmp_path / "empty"))
    (tmp_path / "tiny.txt").write_text("hi")
    with pytest.raises(DataError, match="only 0 samples"):
        prepare_shards(open_corpus(str(tmp_path / "tiny.txt")), open_url(str(tmp_path / "o")), SPEC)
    with pytest.raises(DataError, match="not a prepared shard set"):
        read_manifest(open_url(str(tmp_path)))


def test_ensure_shards_reuses_the_cache(tmp_path):
    src = _text_dir(tmp_path)
    d1, m1 = ensure_shards(str(src), str(tmp_path / "cache"), SPEC)
    mtime = (tmp_path / "cache" / d1.url.rsplit("/", 1)[-1] / "manifest.json").stat().st_mtime
    d2, m2 = ensure_shards(str(src), str(tmp_path / "cache"), SPEC)
    assert d1.url == d2.url and m1 == m2
    assert (tmp_path / "cache" / d1.url.rsplit("/", 1)[-1] / "manifest.json").stat().st_mtime == mtime


def test_stdlib_corpus_is_deterministic():
    a, b = open_corpus("python-stdlib"), open_corpus("python-stdlib")
    assert a.fingerprint() == b.fingerprint() and len(a.files) > 100
    doc = next(a.documents(10_000))
    assert isinstance(doc, str) and doc
    assert np.all(np.frombuffer(doc.encode(), np.uint8) < 256)

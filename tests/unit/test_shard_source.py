"""A prepared shard set as data.source (no Ray): found and verified on the driver from its manifest and one listing,
never prepared again; another tokenizer or seq_len, a crafted manifest, a missing or resized shard refused in one
sentence; a shard corrupted at its own size refused by the rank that reads it, before any of its samples is used."""

from __future__ import annotations

import json
import pickle
import shutil

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from cs3ray.config import load_config
from cs3ray.data import DataError, prepared_shards, read_split
from cs3ray.data.cache import CacheError
from cs3ray.data.shard_source import find_prepared
from cs3ray.data.shards import MANIFEST
from cs3ray.data.stream import TrainStream
from cs3ray.models import ByteTokenizer, train_bpe
from cs3ray.storage import Storage

from conftest import ROOT
from helpers.shard_sets import make_shard_set

SEQ = 8


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A real shard set of 3 train shards (seq_len 8), copied per test by `copy`."""
    dest = tmp_path_factory.mktemp("prepared") / "set"
    make_shard_set(dest, n_shards=3, samples_per_shard=16, seq_len=SEQ)
    return dest


def copy(prepared, tmp_path):
    dest = tmp_path / "set"
    shutil.copytree(prepared, dest)
    return dest


def edit_manifest(dest, change) -> None:
    manifest = json.loads((dest / MANIFEST).read_text())
    change(manifest)
    (dest / MANIFEST).write_text(json.dumps(manifest))


def refused(dest, match: str, tokenizer=None, seq_len: int = SEQ) -> str:
    with pytest.raises(DataError, match=match) as err:
        prepared_shards(str(dest), None, tokenizer or ByteTokenizer(), seq_len)
    message = str(err.value)
    assert "\n" not in message and str(dest) in message
    return message


def test_a_prepared_set_is_verified_from_its_manifest_and_listing_alone(prepared, tmp_path, monkeypatch):
    dest = copy(prepared, tmp_path)
    read: list[str] = []
    real = Storage.read_bytes
    monkeypatch.setattr(Storage, "read_bytes", lambda self, *parts: read.append(parts[-1]) or real(self, *parts))
    storage, manifest = prepared_shards(str(dest), None, ByteTokenizer(), SEQ)
    assert storage.url == str(dest) and manifest == json.loads((dest / MANIFEST).read_text())
    assert read == [MANIFEST]  # no shard's bytes on the driver: the ranks check them as they read them


def test_prepare_data_trains_on_the_named_set_and_prepares_nothing(prepared, tmp_path, monkeypatch):
    from cs3ray.train import driver

    dest = copy(prepared, tmp_path)
    before = {p.name: p.read_bytes() for p in dest.iterdir()}

    def prepare(*args, **kwargs):
        raise AssertionError("a named shard set was prepared again")

    monkeypatch.setattr(driver, "ensure_shards", prepare)
    cfg = load_config(ROOT / "configs/tiny.yaml", [f"data.source={dest}", f"train.seq_len={SEQ}",
                                                   f"data.cache_dir={tmp_path / 'cache'}"])
    shards, manifest = driver.prepare_data(cfg)
    assert shards.url == str(dest) and manifest["seq_len"] == SEQ
    assert not (tmp_path / "cache").exists()
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == before


def test_corpora_are_not_shard_sets(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text " * 100)
    assert find_prepared(str(corpus)) is None
    assert find_prepared(str(corpus / "a.txt")) is None
    assert find_prepared("python-stdlib") is None
    # A web app's manifest.json or a parquet split of text among the corpus' files does not make it a shard set.
    (corpus / MANIFEST).write_text(json.dumps({"name": "app", "icons": []}))
    pq.write_table(pa.table({"text": ["a document"] * 4}), corpus / "train-00000.parquet")
    assert find_prepared(str(corpus)) is None
    (corpus / MANIFEST).unlink()
    assert find_prepared(str(corpus)) is None


def test_shards_without_a_manifest_are_an_unfinished_preparation(prepared, tmp_path):
    dest = copy(prepared, tmp_path)
    (dest / MANIFEST).unlink()
    refused(dest, r"holds shards but no manifest.json: an unfinished preparation")


class _Sentinel:
    """Unpickling this writes a file: a manifest that is a pickle must never get that far."""

    path = ""

    def __reduce__(self):
        return (open, (self.path, "w"))


CRAFTED = {
    "not JSON": (lambda m: None, b"{\"format_version\": 1, ", "is corrupt or of another format version"),
    "a path": (lambda m: m["splits"]["train"][0].update(file="../outside.parquet"), None, "names the file"),
    "twice": (lambda m: m["splits"]["train"][1].update(file=m["splits"]["train"][0]["file"]), None, "twice"),
    "totals": (lambda m: m["samples"].update(train=m["samples"]["train"] + 1), None, "do not add up"),
    "tokens": (lambda m: m.update(tokens=m["tokens"] + 1), None, "do not add up"),
    "no seq_len": (lambda m: m.pop("seq_len"), None, "records no valid seq_len"),
    "empty shard": (lambda m: m["splits"]["val"][0].update(samples=0), None, "with no samples"),
    "sha256": (lambda m: m["splits"]["train"][0].update(sha256="../x"), None, "malformed sha256"),
    "version": (lambda m: m.update(format_version=99), None, "of another format version"),
    "tokenizer": (lambda m: m.update(tokenizer={"type": "code", "module": "os"}), None, "tokenizer type 'code'"),
}


@pytest.mark.parametrize("case", sorted(CRAFTED))
def test_a_crafted_manifest_is_refused_before_training(prepared, tmp_path, case):
    dest = copy(prepared, tmp_path)
    change, raw, match = CRAFTED[case]
    if raw is None:
        edit_manifest(dest, change)
    else:
        (dest / MANIFEST).write_bytes(raw)
    refused(dest, match)


def test_a_pickled_manifest_is_never_unpickled(prepared, tmp_path):
    dest = copy(prepared, tmp_path)
    _Sentinel.path = str(tmp_path / "unpickled")
    (dest / MANIFEST).write_bytes(pickle.dumps(_Sentinel()))
    refused(dest, "is corrupt or of another format version")
    assert not (tmp_path / "unpickled").exists()


def test_another_tokenizer_or_seq_len_is_one_sentence_naming_both(prepared, tmp_path):
    dest = copy(prepared, tmp_path)
    msg = refused(dest, "was prepared with", seq_len=16)
    assert msg == (f"data.source '{dest}' was prepared with tokenizer byte and seq_len 8; this job uses tokenizer "
                   "byte and seq_len 16 (data.tokenizer, train.seq_len).")
    bpe = train_bpe(["a shard set prepared once, trained on many times"] * 20, 300)
    msg = refused(dest, "was prepared with", tokenizer=bpe)
    assert f"with tokenizer byte and seq_len 8; this job uses tokenizer {bpe.describe()} and seq_len 8" in msg


def test_a_missing_or_resized_shard_is_refused_by_the_listing(prepared, tmp_path):
    dest = copy(prepared, tmp_path)
    total = len(list(dest.glob("*.parquet")))
    (dest / "train-00001.parquet").unlink()
    refused(dest, rf"lacks 1 of the {total} shards its manifest lists \(the first: 'train-00001.parquet'\)")
    shutil.copy(prepared / "train-00001.parquet", dest / "train-00001.parquet")
    size = (dest / "val-00000.parquet").stat().st_size
    (dest / "val-00000.parquet").write_bytes(b"PAR1")
    refused(dest, rf"val-00000.parquet' holds 4 bytes, but the manifest lists {size} \(truncated or replaced\)")


def test_a_shard_corrupted_at_its_size_is_refused_by_the_rank_that_reads_it(prepared, tmp_path):
    dest = copy(prepared, tmp_path)
    for name in ("train-00002.parquet", "val-00000.parquet"):
        data = bytearray((dest / name).read_bytes())
        data[len(data) // 2] ^= 0xFF
        (dest / name).write_bytes(bytes(data))
    storage, manifest = prepared_shards(str(dest), None, ByteTokenizer(), SEQ)  # sizes match: the driver passes it
    with pytest.raises(DataError, match=r"val-00000.parquet' does not match its checksum"):
        read_split(storage, manifest, "val")  # what every rank reads first
    stream = TrainStream(8, seed=0, shards_url=str(dest), rank=0, world=1, cache={"disk_dir": str(tmp_path / "l2")})
    try:
        with pytest.raises(CacheError, match=r"train-00002.parquet' does not match its checksum"):
            for _ in range(stream.order.total // 8 + 1):  # one epoch reads every train shard
                next(stream)
    finally:
        stream.close()
    assert not list((tmp_path / "l2").rglob("train-00002.parquet"))  # not admitted to the node's cache either

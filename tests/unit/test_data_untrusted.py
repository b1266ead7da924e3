"""Shard sets and Hugging Face directories from an untrusted source: the file names their manifests and indexes
list are names, never paths, and a shard's claimed sample count is checked against its bytes."""

from __future__ import annotations

import json
import os

import pytest

from cs3ray.ckpt.hf_import import INDEX, import_hf
from cs3ray.config.schema import CacheConfig
from cs3ray.data.cache import CacheError, TieredCache, warm_node
from cs3ray.data.cache.disk import DiskTier
from cs3ray.data.cache.policy import NoEvict
from cs3ray.data.corpus import DataError
from cs3ray.data.shards import MANIFEST, ShardSpec, ensure_shards, read_manifest, read_split
from cs3ray.errors import UserError
from cs3ray.models.hf_llama import HFModelError
from cs3ray.storage import open_url

from helpers.shard_sets import make_shard_set
from helpers.untrusted import HF_CONFIG, Outside

NAMES = ["climbing", "absolute", "climbing-inside", "backslash", "nul", "empty"]


@pytest.fixture(scope="module")
def shard_set(tmp_path_factory):
    """(folder, manifest text) of a real two-shard set, copied per test by `forge`."""
    dest = tmp_path_factory.mktemp("shards") / "set"
    make_shard_set(dest, n_shards=2, samples_per_shard=16, seq_len=8)
    return dest


def forge(src, dest, change):
    """A copy of shard set `src` at `dest` whose manifest's first train entry `change(entry)` edits."""
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    manifest = json.loads((dest / MANIFEST).read_text())
    change(manifest["splits"]["train"][0])
    (dest / MANIFEST).write_text(json.dumps(manifest))
    return manifest


@pytest.mark.parametrize("kind", NAMES)
def test_a_shard_manifest_naming_a_path_is_refused(shard_set, tmp_path, kind):
    # The forged entry carries the sentinel's size and sha256, so only the name check can stop the read (and
    # the L2 write: os.path.join drops the cache folder before an absolute name).
    outside = Outside(tmp_path)
    dest = tmp_path / "set"
    name = outside.names(dest)[kind]
    manifest = forge(shard_set, dest, lambda e: e.update(file=name, bytes=outside.size, sha256=outside.sha256))
    refused = r"manifest.json' names the file .*; refusing to read it\.$"
    with pytest.raises(DataError, match=refused):
        read_manifest(open_url(str(dest)))
    with pytest.raises(DataError, match=refused):
        warm_node(str(dest), CacheConfig(disk_dir=str(tmp_path / "l2")))  # cs3 cache warm
    entries = manifest["splits"]["train"]
    with pytest.raises(CacheError, match=r"the manifest of '.*' names the file"):
        TieredCache(open_url(str(dest)), entries, disk_dir=str(tmp_path / "l2"))  # a training worker's reader
    with pytest.raises(CacheError, match="shard set's manifest names the file"):
        DiskTier(str(tmp_path / "l2"), 2**20, NoEvict()).path("ns", name)
    outside.untouched()
    assert not [f for _, _, files in os.walk(tmp_path / "l2") for f in files if not f.startswith(".")]


def test_a_forged_shard_set_in_the_cache_is_refused_not_prepared_over(tmp_path):
    src = tmp_path / "corpus.txt"
    src.write_text("".join(f"line {i} of a small corpus\n" for i in range(200)))
    spec = ShardSpec(seq_len=8, samples_per_shard=16, val_fraction=0.1, max_bytes=10**6, seed=0)
    dest, _ = ensure_shards(str(src), str(tmp_path / "cache"), spec)
    outside = Outside(tmp_path)
    folder = tmp_path / "cache" / dest.url.rsplit("/", 1)[-1]
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest["splits"]["train"][0]["file"] = outside.names(folder)["climbing"]
    forged = json.dumps(manifest)
    (folder / MANIFEST).write_text(forged)
    with pytest.raises(DataError, match=r"manifest.json' names the file '\.\./\.\./outside/secret'"):
        ensure_shards(str(src), str(tmp_path / "cache"), spec)
    assert (folder / MANIFEST).read_text() == forged  # left for the user to look at, not deleted and rebuilt
    outside.untouched()


def test_a_claimed_sample_count_is_checked_against_the_shard(shard_set, tmp_path):
    dest = tmp_path / "set"
    manifest = forge(shard_set, dest, lambda e: e.update(samples=e["samples"] + 10**6))
    entry = manifest["splits"]["train"][0]
    claimed = rf"holds {entry['samples'] - 10**6} samples, but the manifest claims {entry['samples']}"
    with pytest.raises(DataError, match=claimed):
        read_split(open_url(str(dest)), manifest, "train")
    with TieredCache(open_url(str(dest)), manifest["splits"]["train"], disk_dir=str(tmp_path / "l2")) as cache:
        with pytest.raises(DataError, match=claimed):
            cache.get(entry["file"])


def hf_dir(path, shard: str):
    """A Hugging Face directory whose index names `shard` (the config is valid; no weights are needed)."""
    path.mkdir()
    (path / "config.json").write_text(json.dumps(HF_CONFIG))
    (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": {"model.norm.weight": shard}}))
    return path


@pytest.mark.parametrize("kind", ["climbing", "absolute", "backslash", "nul", "empty"])
def test_an_hf_index_naming_a_path_is_refused(tmp_path, kind):
    outside = Outside(tmp_path)
    src = tmp_path / "hf"
    shard = {**outside.names(src), "climbing": "../x.safetensors", "backslash": "..\\x.safetensors"}[kind]
    (tmp_path / "x.safetensors").write_bytes(b"\0" * 8)
    hf_dir(src, shard)
    with pytest.raises(HFModelError, match=rf"'{src}/{INDEX}' names the file .*; refusing to read it\.$"):
        import_hf(str(src), str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()
    outside.untouched()


def test_names_of_other_formats_may_hold_any_character_but_a_path():
    from cs3ray.names import check_name

    assert check_name("model-00001-of-00002 (copy).safetensors", "index", ours=False)
    with pytest.raises(UserError, match="characters cs3ray never writes"):
        check_name("model (copy).safetensors", "'x/manifest.json'")

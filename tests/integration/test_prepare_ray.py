"""`cs3 data prepare` as a Ray Data pipeline: byte-identical to the single-process preparation at any
parallelism, a re-run leaves verified shards alone, S3 in and out, and a bad source is one line."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from cs3ray.config import load_config
from cs3ray.data import DataError, ShardSpec, ensure_shards, open_corpus, prepare_shards, prepare_shards_ray
from cs3ray.models import train_bpe
from cs3ray.storage import open_url
from cs3ray.train.driver import prepare_data
from cs3ray_cli.main import app

# max_bytes cuts the corpus mid-way, so the cut-off document must be the same one on both paths.
SPEC = ShardSpec(seq_len=16, samples_per_shard=16, val_fraction=0.1, max_bytes=14_000, seed=3)


def _corpus(root) -> str:
    """Text files of random words, a jsonl file, and after the cut-off a jsonl line that is not JSON."""
    src = root / "src"
    src.mkdir()
    rng = np.random.default_rng(0)
    words = ["ray", "data", "shard", "token", "packing", "order", "cluster", "node", "élan", "数据"]
    for i in range(12):
        (src / f"a{i:02d}.txt").write_text(" ".join(rng.choice(words, 200)))
    (src / "b.jsonl").write_text("".join(json.dumps({"text": " ".join(rng.choice(words, 30))}) + "\n"
                                         for _ in range(20)))
    (src / "c.txt").write_bytes(b"\xff\xfe\x00" * 10)  # skipped: not UTF-8
    (src / "z.jsonl").write_text("not json\n")  # never reached: max_bytes is met before it
    return str(src)


def _files(path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_ray_pipeline_is_byte_identical_at_any_parallelism_and_skips_on_rerun(ray_client, tmp_path):
    src = _corpus(tmp_path)
    corpus = open_corpus(src)
    tok = train_bpe((p.read_text() for p in (tmp_path / "src").glob("a*.txt")), 300)
    prepare_shards(corpus, open_url(str(tmp_path / "single")), SPEC, tokenizer=tok)
    expected = _files(tmp_path / "single")
    assert len(expected) > 5
    for parallelism in (1, 3):
        m, kept = prepare_shards_ray(corpus, open_url(str(tmp_path / f"p{parallelism}")), SPEC, tokenizer=tok,
                                     parallelism=parallelism)
        assert kept == 0 and _files(tmp_path / f"p{parallelism}") == expected
    # A finished set whose shards verify is left as it is; after an interruption (no manifest) and a
    # damaged shard, only that shard is written again.
    out = open_url(str(tmp_path / "p3"))
    m2, kept = prepare_shards_ray(corpus, out, SPEC, tokenizer=tok, parallelism=2)
    assert m2 == m and kept == len(expected) - 1
    (tmp_path / "p3" / "manifest.json").unlink()
    (tmp_path / "p3" / "train-00001.parquet").write_bytes(b"truncated")
    _, kept = prepare_shards_ray(corpus, out, SPEC, tokenizer=tok, parallelism=2)
    assert kept == len(expected) - 2 and _files(tmp_path / "p3") == expected


def test_a_bad_file_within_max_bytes_is_one_error(ray_client, tmp_path):
    corpus = open_corpus(_corpus(tmp_path))
    spec = dataclasses.replace(SPEC, max_bytes=10**6)  # now z.jsonl is read, as the single process would
    with pytest.raises(DataError, match=r"z.jsonl' line 1 is not valid JSON\.$"):
        prepare_shards_ray(corpus, open_url(str(tmp_path / "out")), spec, parallelism=2)


def test_train_prepares_with_the_pipeline(ray_client, tmp_path):
    # `cs3 train` prepares inside its cluster through `prepare_data`: the same shards as this process makes.
    src = _corpus(tmp_path)
    cfg = load_config("configs/tiny.yaml", [f"data.source={src}", f"data.cache_dir={tmp_path / 'cache'}",
                                            "train.seq_len=16", "data.samples_per_shard=16", "data.max_bytes=14000"])
    shards, manifest = prepare_data(cfg)
    spec = ShardSpec(16, 16, cfg.data.val_fraction, 14000, cfg.data.seed)
    single, _ = ensure_shards(src, str(tmp_path / "single"), spec)
    assert shards.url.rsplit("/", 1)[-1] == single.url.rsplit("/", 1)[-1]
    assert _files(tmp_path / "cache" / shards.url.rsplit("/", 1)[-1]) == _files(tmp_path / "single" /
                                                                               single.url.rsplit("/", 1)[-1])


def test_cli_prepares_s3_to_s3(ray_client, ray_head, s3_server, tmp_path):
    # In this process (the CLI keeps the connection the fixture made): a cs3 subprocess would spend
    # most of this test starting up and connecting.
    import s3fs

    endpoint, options = s3_server
    src = _corpus(tmp_path)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.put(src, "cs3/prep-src", recursive=True)
    creds = [f"storage.options.{k}={v}" for k, v in (("key", "testing"), ("secret", "testing"),
                                                     ("client_kwargs.endpoint_url", endpoint),
                                                     ("client_kwargs.region_name", "us-east-1"))]
    args = ["--seq-len", "16", "--samples-per-shard", "16", "--val-fraction", "0.1", "--max-bytes", "14000",
            "--seed", "3", "--parallelism", "2", "--address", ray_head.address, "--json"]
    res = CliRunner().invoke(app, ["data", "prepare", "s3://cs3/prep-src", "s3://cs3/prep-out", *args, *creds])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["shards_kept"] == 0
    prepare_shards(open_corpus(src), open_url(str(tmp_path / "local")), SPEC)
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    remote = json.loads(fs.cat_file("cs3/prep-out/manifest.json"))
    assert remote["splits"] == local["splits"] and remote["tokens"] == local["tokens"] == summary["tokens"]


def test_cli_bad_source_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "does not exist" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1

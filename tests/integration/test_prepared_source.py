"""`cs3 data prepare SRC s3://...` then `data.source: s3://...`: a run trains on that shard set as it is (nothing
prepared again, the shards read are the set's); one of another seq_len or tokenizer is one line from `cs3 train`
(exit 2) before any cluster or run directory; a shard resized on S3 is refused from the listing."""

from __future__ import annotations

import json
import uuid

import pytest
from typer.testing import CliRunner

from cs3ray.config import load_config
from cs3ray.data import prepared_shards
from cs3ray.data.cache.tiered import namespace
from cs3ray.data.corpus import DataError
from cs3ray.models import ByteTokenizer, train_bpe
from cs3ray_cli.main import app

from conftest import ROOT

SEQ = 32


def _s3_args(endpoint: str) -> list[str]:
    """`storage.options` overrides that reach the moto server."""
    return [f"storage.options.{k}={v}" for k, v in (("key", "testing"), ("secret", "testing"),
                                                    ("client_kwargs.endpoint_url", endpoint),
                                                    ("client_kwargs.region_name", "us-east-1"))]


@pytest.fixture(scope="module")
def prepared(ray_client, ray_head, s3_server, tmp_path_factory):
    """(URL, summary) of a shard set `cs3 data prepare` wrote to S3 (in this process, on the session's head)."""
    endpoint, _ = s3_server
    src = tmp_path_factory.mktemp("corpus") / "code.txt"
    src.write_text("".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(800)))
    url = f"s3://cs3/prepared-{uuid.uuid4().hex[:8]}"
    res = CliRunner().invoke(app, ["data", "prepare", str(src), url, "--seq-len", str(SEQ), "--samples-per-shard",
                                   "64", "--val-fraction", "0.05", "--parallelism", "1", "--address",
                                   ray_head.address, "--json", *_s3_args(endpoint)])
    assert res.exit_code == 0, res.output
    return url, json.loads(res.stdout.strip().splitlines()[-1])


def test_train_reads_the_prepared_set_as_it_is(prepared, ray_head, s3_server, tmp_path, monkeypatch):
    import s3fs

    from cs3ray.train import driver

    url, summary = prepared
    endpoint, options = s3_server
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    before = {f["name"]: (f["size"], f["ETag"]) for f in fs.ls(url, detail=True, refresh=True)}
    assert summary["shards"]["train"] >= 4 and len(before) == summary["shards"]["train"] + summary["shards"]["val"] + 1

    def prepare(*args, **kwargs):
        raise AssertionError("a named shard set was prepared again")

    monkeypatch.setattr(driver, "prepare_corpus", prepare)
    cfg = load_config(ROOT / "configs/tiny.yaml", [
        f"data.source={url}", f"data.cache_dir={tmp_path / 'cache'}", f"cache.disk_dir={tmp_path / 'l2'}",
        f"run.dir={tmp_path / 'run'}", f"train.seq_len={SEQ}", "model.dim=64", "model.n_layers=2",
        "model.n_heads=4", "model.ffn_dim=128", "train.batch_size=8", "train.steps=2", "train.warmup_steps=0",
        "train.log_every=1", "train.eval_every=2", "train.eval_batches=1", "checkpoint.every=100",
        "cluster.workers=1", "precision=fp32", *_s3_args(endpoint)])
    events: list[dict] = []
    result = driver.train(cfg, address=ray_head.address, on_event=events.append, quiet=True)
    assert result["steps"] == 2
    assert not [e for e in events if e["event"] == "prepare"] and not (tmp_path / "cache").exists()
    # The worker read the set's own shards from S3, through its node's cache, and the set is as it was.
    l2 = tmp_path / "l2" / namespace(url)
    assert {p.name for p in l2.glob("train-*.parquet")} <= {n.rsplit("/", 1)[-1] for n in before}
    assert len(list(l2.glob("train-*.parquet"))) >= 1
    assert {f["name"]: (f["size"], f["ETag"]) for f in fs.ls(url, detail=True, refresh=True)} == before


def test_cli_refuses_another_seq_len_or_tokenizer_in_one_line(prepared, s3_server, tmp_path):
    url, _ = prepared
    endpoint, _ = s3_server
    tok, bpe = tmp_path / "tok.json", train_bpe(["def f(x):\n    return x * 2 + 1\n"] * 50, 300)
    tok.write_text(bpe.to_json())
    cases = [([f"train.seq_len={2 * SEQ}"], f"this job uses tokenizer byte and seq_len {2 * SEQ}"),
             ([f"train.seq_len={SEQ}", f"data.tokenizer={tok}"], f"this job uses tokenizer {bpe.describe()} and "
                                                                  f"seq_len {SEQ}")]
    for i, (extra, expected) in enumerate(cases):
        run_dir = tmp_path / f"run{i}"
        # No --address and no cluster: the shard set is refused before one would start.
        res = CliRunner().invoke(app, ["train", str(ROOT / "configs/tiny.yaml"), f"data.source={url}",
                                       f"run.dir={run_dir}", *extra, *_s3_args(endpoint)])
        assert res.exit_code == 2, res.output
        lines = [line for line in res.output.splitlines() if line.strip()]
        assert len(lines) == 1, res.output
        line = lines[0]
        assert line.startswith(f"error: data.source '{url}' was prepared with tokenizer byte and seq_len {SEQ};")
        assert f"{expected} (data.tokenizer, train.seq_len)." in line and "Traceback" not in res.output
        assert not run_dir.exists()


def test_a_shard_resized_on_s3_is_refused_from_the_listing(prepared, s3_server):
    import s3fs

    url, _ = prepared
    _, options = s3_server
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    copy = url + "-resized"
    for name in fs.ls(url, refresh=True):
        fs.copy(name, f"{copy}/{name.rsplit('/', 1)[-1]}")
    storage, manifest = prepared_shards(copy, options, ByteTokenizer(), SEQ)
    assert storage.url == copy and manifest["seq_len"] == SEQ
    entry = manifest["splits"]["train"][1]
    fs.pipe_file(f"{copy}/{entry['file']}", b"PAR1")  # after a listing: fsspec's cached one must not hide it
    with pytest.raises(DataError, match=rf"{entry['file']}' holds 4 bytes, but the manifest lists {entry['bytes']}"):
        prepared_shards(copy, options, ByteTokenizer(), SEQ)

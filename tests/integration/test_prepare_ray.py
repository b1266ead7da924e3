"""`cs3 data prepare` as a Ray Data pipeline: byte-identical to the single-process preparation at any
parallelism and on two nodes (both doing work, a file read in pieces), a re-run leaves verified shards alone, S3 in and out,
one tokenizer thread per task, and a bad source or an unreachable cluster is one line."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from typer.testing import CliRunner

from cs3ray.config import load_config
from cs3ray.data import DataError, ShardSpec, ensure_shards, open_corpus, prepare_shards, prepare_shards_ray
from cs3ray.models import train_bpe
from cs3ray.storage import open_url
from cs3ray.train.driver import prepare_data
from cs3ray_cli.main import app

from conftest import run_cs3
from helpers.cluster import simulated_nodes

# max_bytes cuts the corpus mid-way, so the cut-off document must be the same one on both paths.
SPEC = ShardSpec(seq_len=16, samples_per_shard=16, val_fraction=0.1, max_bytes=14_000, seed=3)
SPEC_ARGS = ["--seq-len", "16", "--samples-per-shard", "16", "--val-fraction", "0.1", "--max-bytes", "14000",
             "--seed", "3"]


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


def _s3_args(endpoint: str) -> list[str]:
    """`storage.options` overrides that reach the moto server."""
    return [f"storage.options.{k}={v}" for k, v in (("key", "testing"), ("secret", "testing"),
                                                    ("client_kwargs.endpoint_url", endpoint),
                                                    ("client_kwargs.region_name", "us-east-1"))]


def test_ray_pipeline_is_byte_identical_at_any_parallelism_and_skips_on_rerun(ray_client, tmp_path):
    src = _corpus(tmp_path)
    corpus = open_corpus(src)
    tok = train_bpe((p.read_text() for p in (tmp_path / "src").glob("a*.txt")), 300)
    prepare_shards(corpus, open_url(str(tmp_path / "single")), SPEC, tokenizer=tok)
    expected = _files(tmp_path / "single")
    assert len(expected) > 5
    for parallelism in (1, 3):
        m, kept, _ = prepare_shards_ray(corpus, open_url(str(tmp_path / f"p{parallelism}")), SPEC, tokenizer=tok,
                                     parallelism=parallelism)
        assert kept == 0 and _files(tmp_path / f"p{parallelism}") == expected
    # A finished set whose shards verify is left as it is; after an interruption (no manifest) and a
    # damaged shard, only that shard is written again.
    out = open_url(str(tmp_path / "p3"))
    m2, kept, _ = prepare_shards_ray(corpus, out, SPEC, tokenizer=tok, parallelism=2)
    assert m2 == m and kept == len(expected) - 1
    (tmp_path / "p3" / "manifest.json").unlink()
    (tmp_path / "p3" / "train-00001.parquet").write_bytes(b"truncated")
    _, kept, _ = prepare_shards_ray(corpus, out, SPEC, tokenizer=tok, parallelism=2)
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
    args = [*SPEC_ARGS, "--parallelism", "2", "--address", ray_head.address, "--json", *_s3_args(endpoint)]
    res = CliRunner().invoke(app, ["data", "prepare", "s3://cs3/prep-src", "s3://cs3/prep-out", *args])
    assert res.exit_code == 0, res.output
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["shards_kept"] == 0 and summary["driver_peak_rss_mb"] > 0
    prepare_shards(open_corpus(src), open_url(str(tmp_path / "local")), SPEC)
    local = json.loads((tmp_path / "local" / "manifest.json").read_text())
    remote = json.loads(fs.cat_file("cs3/prep-out/manifest.json"))
    assert remote["splits"] == local["splits"] and remote["tokens"] == local["tokens"] == summary["tokens"]


# Threads of a fresh process: before any encoding, after encoding inside `_one_thread`, and after encoding
# outside it (when the tokenizer's pool starts).
_THREADS = """
import os, sys
from cs3ray.data.prepare import _one_thread
from cs3ray.models import tokenizer_from_json
tok = tokenizer_from_json(open(sys.argv[1]).read(), "tokenizer.json")
texts = ["ray data shard token packing order " * 20] * 64
counts = [len(os.listdir("/proc/self/task"))]
with _one_thread():
    tok.encode_batch(texts)
counts.append(len(os.listdir("/proc/self/task")))
assert os.environ.get("TOKENIZERS_PARALLELISM") is None
tok.encode_batch(texts)
print(*counts, len(os.listdir("/proc/self/task")))
"""


def test_tokenize_tasks_start_no_tokenizer_threads(tmp_path):
    # A task holds one CPU: its tokenizer must not start a pool of every core. Only a fresh process shows
    # it, as a pool once started stays (this one's may have started in another test).
    (tmp_path / "tok.json").write_text(train_bpe(["ray data shard token packing order"] * 50, 300).to_json())
    proc = subprocess.run([sys.executable, "-c", _THREADS, str(tmp_path / "tok.json")], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    before, inside, after = map(int, proc.stdout.split())
    assert inside == before < after


def test_cli_unreachable_cluster_is_one_line(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = run_cs3(["data", "prepare", _corpus(tmp_path), str(tmp_path / "out"), "--address", "127.0.0.1:1"],
                   env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert "cannot reach the Ray cluster at '127.0.0.1:1'" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def two_nodes():
    """Two simulated nodes of one CPU each: two tasks at once cannot both run on one node."""
    with simulated_nodes(2, num_cpus=1) as cluster:
        yield cluster


def _stage_nodes(dashboard: str) -> dict[str, set[str]]:
    """The nodes each stage's tasks ran on, as the cluster's state API (its dashboard) recorded them."""
    from ray.util.state import list_tasks

    # The dashboard's URL, not the GCS address: resolving that would point this process' internal KV
    # client at the other cluster.
    address = dashboard if "://" in dashboard else f"http://{dashboard}"
    stages = ("MapBatches(_tokenize_group)", "_write_shards")
    return {stage: {t.node_id for t in list_tasks(address=address, filters=[("name", "=", stage)], detail=True,
                                                  limit=1000, raise_on_missing_output=False) if t.node_id}
            for stage in stages}


@pytest.mark.slow
def test_cli_on_two_nodes_shares_the_work_and_writes_what_one_process_writes(two_nodes, s3_server, tmp_path,
                                                                              monkeypatch):
    # `cs3 data prepare --address` as a user runs it, in its own process (this one may be connected to the
    # session's head): URLs are read and written from both nodes.
    import s3fs

    endpoint, options = s3_server
    src = _corpus(tmp_path)
    fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
    fs.put(src, "cs3/two-src", recursive=True)
    tok = train_bpe((p.read_text() for p in (tmp_path / "src").glob("a*.txt")), 300)
    (tmp_path / "tok.json").write_text(tok.to_json())
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # --piece-bytes: the JSONL file is read in four pieces, by tasks on both nodes.
    proc = run_cs3(["data", "prepare", "s3://cs3/two-src", "s3://cs3/two-out", *SPEC_ARGS, "--tokenizer",
                    str(tmp_path / "tok.json"), "--piece-bytes", "1024", "--address", two_nodes.address, "--json",
                    *_s3_args(endpoint)],
                   env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["shards_kept"] == 0
    nodes = {n["NodeID"] for n in two_nodes.global_state.node_table()}
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # the state API would ask the session's head instead
    deadline = time.time() + 20  # task events reach the state API about once a second
    ran_on = _stage_nodes(two_nodes.webui_url)
    while any(ran != nodes for ran in ran_on.values()) and time.time() < deadline:
        time.sleep(0.5)
        ran_on = _stage_nodes(two_nodes.webui_url)
    assert len(nodes) == 2 and all(ran == nodes for ran in ran_on.values()), ran_on
    # The same corpus (so the same source in the manifest), prepared in this process one file after another.
    prepare_shards(open_corpus("s3://cs3/two-src", options=options), open_url(str(tmp_path / "single")), SPEC,
                   tokenizer=tok)
    assert {n.rsplit("/", 1)[-1]: fs.cat_file(n) for n in fs.ls("cs3/two-out", refresh=True)} == \
        _files(tmp_path / "single")


def test_cli_bad_source_is_one_line(tmp_path):
    res = CliRunner().invoke(app, ["data", "prepare", str(tmp_path / "missing"), str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert "does not exist" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1

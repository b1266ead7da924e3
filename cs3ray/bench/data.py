"""`cs3 bench data`: Ray Data in cs3ray's data path against its peers, in one run and one Ray cluster.

(a) prepare: the Ray Data pipeline (`prepare_shards_ray`, one task per core) against the
    single-process `prepare_shards` (the tokenizer's own threads on every core), the same corpus
    and byte-level BPE, each timed from the first read to the manifest written; their outputs
    must be identical. MB/s of source text.
(b) read: one cold epoch of the train shards (a) wrote, from a moto S3 server behind the latency
    proxy of `bench cache`: Ray Data's own `read_parquet` on the shard URLs with its default
    parallelism (what a Ray user writes) against cs3ray's loader (`TrainStream`, the exact global
    order through the tiered cache) with an empty L2 (cold) and again with that L2 (warm). Both
    deliver micro-batches of token ids; MB/s of shard bytes.
(c) train: tokens/s of configs/tiny.yaml with `data.loader=ray_data` against `data.loader=direct`,
    taking turns (each round in the other order); the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from typing import Any, Callable, Iterator

from cs3ray.config import load_config
from cs3ray.config.schema import CacheConfig
from cs3ray.data import ShardSpec, open_corpus, prepare_shards, prepare_shards_ray, train_tokenizer
from cs3ray.data.corpus import STDLIB, Corpus
from cs3ray.data.shards import MANIFEST, TOKEN_COLUMN, decode_tokens
from cs3ray.data.stream import TrainStream
from cs3ray.models import load_tokenizer
from cs3ray.ops.cluster import ray_cluster
from cs3ray.storage import open_url
from cs3ray.train.driver import prepare_data

from . import stats
from .loopback_s3 import LatencyProxy, MotoServer, make_bucket, s3_options
from .train import cs3_run

BUCKET = "cs3"
TRAIN_CONFIG = "configs/tiny.yaml"
VOCAB = 4096
TOKENIZER_TEXT = 4 * 2**20  # the slice of the standard library the BPE is trained on (not timed)
SEQ_LEN, SAMPLES_PER_SHARD = 128, 2048  # tiny.yaml's sample length; the config's default shard size
WARMUP_TEXT = 2**18
BATCH = 256  # rows per batch in (b) on both sides: Ray Data's default batch_size
NICENESS = "RAY_worker_niceness"  # read by an embedded cluster's raylet as it starts
TARGETS = {"prepare_ratio": {"at_least": 0.9}, "cold_over_ray_data_read": {"at_least": 1.0},
           "ray_data_loader_ratio": {"at_least": 0.97}}


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def _ratio(name: str, ours: list[float], theirs: list[float]) -> dict[str, Any]:
    """`name`: the median of the rounds' own ratios (a round's modes ran back to back), with its 95% interval
    and the rounds' ratios."""
    return stats.summarize(name, [round(a / b, 4) for a, b in zip(ours, theirs, strict=True)])


def bench_corpus(max_bytes: int) -> tuple[Corpus, str]:
    """The standard library's Python source; where it holds less than `max_bytes` of text, followed by the
    Python source of this interpreter's installed packages (site-packages, in path order)."""
    stdlib = open_corpus(STDLIB)
    if sum(f.size for f in stdlib.files) >= max_bytes:
        return stdlib, STDLIB
    site = sysconfig.get_paths()["purelib"]
    extra = [f for f in open_corpus(site, "text").files if f.path.endswith(".py")]
    spec = f"{STDLIB} + {site} (*.py)"
    return Corpus(spec, stdlib.storage, stdlib.files + extra, "text", stdlib.text_column), spec


@contextlib.contextmanager
def _workers_at_nice_0() -> Iterator[None]:
    """An embedded cluster started inside runs its worker processes at nice 0, as this process runs."""
    # Ray starts workers at nice 15: on a host shared with other work, the Ray Data sides of (a) and
    # (b) would yield the cores to it while their in-process peers would not.
    saved = os.environ.get(NICENESS)
    os.environ[NICENESS] = "0"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(NICENESS, None)
        else:
            os.environ[NICENESS] = saved


def _prepare(corpus: Corpus, spec: ShardSpec, tok: Any, dest: str, ray_data: bool, cores: int) -> tuple[float, dict]:
    """MB/s of source text and the manifest of one preparation into the empty folder `dest`."""
    chars = [0]

    def progress(n: int) -> None:
        chars[0] += n

    out = open_url(dest)
    t0 = time.perf_counter()
    if ray_data:
        manifest = prepare_shards_ray(corpus, out, spec, progress, tok, parallelism=cores)[0]
    else:
        manifest = prepare_shards(corpus, out, spec, progress, tok)
    return chars[0] / 2**20 / (time.perf_counter() - t0), manifest


def _ray_data_epoch(urls: list[str], options: dict, samples: int) -> float:
    """Seconds for Ray Data's `read_parquet` to deliver every row of the shards as token micro-batches."""
    import pyarrow.fs
    import ray.data

    client = options["client_kwargs"]
    fs = pyarrow.fs.S3FileSystem(access_key=options["key"], secret_key=options["secret"],
                                 endpoint_override=client["endpoint_url"], region=client["region_name"])
    ctx, logger = ray.data.DataContext.get_current(), logging.getLogger("ray.data")
    saved = ctx.enable_progress_bars, logger.level
    # Its progress lines would bury the bench's own; nothing else of Ray Data's defaults is changed.
    ctx.enable_progress_bars = False
    logger.setLevel(logging.ERROR)
    try:
        t0 = time.perf_counter()
        rows = 0
        for batch in ray.data.read_parquet(urls, filesystem=fs).iter_batches(batch_size=BATCH, batch_format="numpy"):
            rows += len(decode_tokens(batch[TOKEN_COLUMN]))
        elapsed = time.perf_counter() - t0
    finally:
        ctx.enable_progress_bars = saved[0]
        logger.setLevel(saved[1])
    if rows != samples:
        raise RuntimeError(f"Ray Data's read_parquet delivered {rows} rows of the {samples} in the shards")
    return elapsed


def _cs3_epoch(url: str, options: dict, l2: str, samples: int) -> float:
    """Seconds for one rank of one epoch of cs3ray's loader (the exact global order) through the tiered cache."""
    t0 = time.perf_counter()
    stream = TrainStream(BATCH, seed=0, shards_url=url, storage_options=options,
                         cache=CacheConfig(disk_dir=l2).model_dump(), rank=0, world=1)
    rows = 0
    try:
        for _ in range(samples // BATCH):
            rows += len(next(stream))
    finally:
        stream.close()
    elapsed = time.perf_counter() - t0
    if rows != samples // BATCH * BATCH:
        raise RuntimeError(f"cs3ray's loader delivered {rows} rows of {samples // BATCH * BATCH}")
    return elapsed


def _read_part(shards: str, work: str, latency_ms: float, rounds: int, say: Callable[[str], None]) -> dict[str, Any]:
    """(b): the shards under `shards` on a loopback S3 store behind the latency proxy, read cold and warm."""
    import s3fs

    manifest = json.loads(open_url(shards).read_text(MANIFEST))
    train = manifest["splits"]["train"]
    total, samples = sum(e["bytes"] for e in train), sum(e["samples"] for e in train)
    moto = MotoServer()
    proxy = None
    try:
        make_bucket(moto.url, BUCKET)
        s3fs.S3FileSystem(**s3_options(moto.url), skip_instance_cache=True).put(
            shards.rstrip("/") + "/", f"{BUCKET}/data/", recursive=True)
        proxy = LatencyProxy(moto.url, latency_ms / 1000)
        options = s3_options(proxy.url)
        url = f"s3://{BUCKET}/data"
        urls = [f"{url}/{e['file']}" for e in train]
        ray_s, cold_s, warm_s = [], [], []
        requests: dict[str, int] = {}  # per epoch, in the first round
        for r in range(rounds):
            l2 = os.path.join(work, f"l2-{r}")
            # Each round in the other order, so a drift of the host's speed reaches both alike.
            modes = ["ray_data", "cs3"] if r % 2 == 0 else ["cs3", "ray_data"]
            for mode in modes:
                before = proxy.requests
                if mode == "ray_data":
                    ray_s.append(_ray_data_epoch(urls, options, samples))
                    requests.setdefault("ray_data", proxy.requests - before)
                else:
                    cold_s.append(_cs3_epoch(url, options, l2, samples))
                    requests.setdefault("cs3_cold", proxy.requests - before)
                    before = proxy.requests
                    warm_s.append(_cs3_epoch(url, options, l2, samples))
                    requests.setdefault("cs3_warm", proxy.requests - before)
            shutil.rmtree(l2, ignore_errors=True)
            say(f"read round {r + 1}: Ray Data {total / 2**20 / ray_s[-1]:.1f}, cs3 cold "
                f"{total / 2**20 / cold_s[-1]:.1f}, warm {total / 2**20 / warm_s[-1]:.1f} MB/s")
        mb = total / 2**20
        return {"shards_mb": round(mb, 2), "train_shards": len(train), "train_samples": samples,
                "latency_ms": latency_ms, "read_rounds": rounds, "batch_rows": BATCH,
                "ray_data_read_mb_s": round(mb / _median(ray_s), 2), "cs3_cold_mb_s": round(mb / _median(cold_s), 2),
                "cs3_warm_mb_s": round(mb / _median(warm_s), 2), "s3_requests_per_epoch": requests,
                # The loader's cold epoch over read_parquet's, per round (the two read back to back).
                **_ratio("cold_over_ray_data_read", ray_s, cold_s),
                "read_runs_mb_s": {"ray_data": [round(mb / s, 2) for s in ray_s],
                                   "cs3_cold": [round(mb / s, 2) for s in cold_s],
                                   "cs3_warm": [round(mb / s, 2) for s in warm_s]}}
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()


def _train_part(root: str, rounds: int, warmup: int, steps: int, workers: int,
                say: Callable[[str], None]) -> dict[str, Any]:
    """(c): tiny.yaml's steady tokens/s with each loader, taking turns in the connected cluster."""
    # The measured steps plus one log window of warm-up (and the step measured for memory, which
    # falls in it only from 2 warm-up steps on: see bench train).
    total = warmup + steps + (1 if warmup < 2 else 0)
    common = [f"cluster.workers={workers}", "precision=fp32", f"train.steps={total}", f"train.log_every={warmup}",
              f"train.eval_every={total}", "train.eval_batches=1", f"checkpoint.every={total}", "checkpoint.keep=1"]
    prepare_data(load_config(TRAIN_CONFIG, common))  # the shards exist before any run is timed
    runs: dict[str, list[float]] = {"ray_data": [], "direct": []}
    for r in range(rounds):
        for loader in (["direct", "ray_data"] if r % 2 == 0 else ["ray_data", "direct"]):
            summary = cs3_run(TRAIN_CONFIG, common + [f"data.loader={loader}"], root, f"{loader}-{r}")
            runs[loader].append(summary["steady_tokens_per_s"])
        say(f"train round {r + 1}: tokens/s ray_data {runs['ray_data'][-1]:,.0f}, direct {runs['direct'][-1]:,.0f}")
    return {"train_config": TRAIN_CONFIG, "train_precision": "fp32", "train_workers": workers, "train_rounds": rounds,
            "train_steps_measured": steps, "train_warmup_steps": total - steps,
            "ray_data_tokens_per_s": round(_median(runs["ray_data"]), 1),
            "direct_tokens_per_s": round(_median(runs["direct"]), 1),
            **_ratio("ray_data_loader_ratio", runs["ray_data"], runs["direct"]),
            "train_runs_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in runs.items()}}


def run(mb: int = 50, latency_ms: float = 20.0, quick: bool = False,
        log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run (a), (b) and (c); returns the issue's JSON keys, the context of each part and the targets."""
    say = log or (lambda m: None)
    started = time.perf_counter()
    if quick:
        # One worker: a second one's start would double the smoke run's longest part. Preparing and reading
        # 2 MB take seconds, so they get the 2 rounds an interval needs; training keeps 1 (inconclusive).
        mb, prep_rounds, read_rounds, train_rounds, warmup, steps, workers = min(mb, 2), 2, 2, 1, 2, 4, 1
    else:
        prep_rounds, read_rounds, train_rounds, warmup, steps = 3, 3, 3, 5, 40
        workers = load_config(TRAIN_CONFIG).cluster.workers
    cores = os.cpu_count() or 1
    max_bytes = mb * 2**20
    corpus, corpus_name = bench_corpus(max_bytes)
    spec = ShardSpec(SEQ_LEN, SAMPLES_PER_SHARD, 0.02, max_bytes, 0)
    work = tempfile.mkdtemp(prefix="cs3-bench-data-")
    try:
        tok_bytes = min(TOKENIZER_TEXT, max_bytes)
        say(f"training a {VOCAB}-id byte-level BPE on {tok_bytes / 2**20:g} MB of the standard library (not timed)")
        train_tokenizer(STDLIB, VOCAB, os.path.join(work, "tokenizer"), max_bytes=tok_bytes)
        tok = load_tokenizer(os.path.join(work, "tokenizer"))
        result: dict[str, Any] = {"corpus": corpus_name, "corpus_mb": mb, "tokenizer": tok.describe(),
                                  "cores": cores, "prepare_rounds": prep_rounds}
        # Room beside the cores for tiny.yaml's 2 workers, Ray Train's controller and Ray Data's tasks.
        with _workers_at_nice_0(), ray_cluster(None, num_cpus=cores + 4, quiet=True, use_recorded=False):
            parts_s = {"setup": time.perf_counter() - started}
            say(f"(a) preparing {mb} MB of {corpus_name}: Ray Data pipeline vs a single process")
            if not quick:
                # Ray starts a cluster's worker processes on first use: an untimed small preparation
                # starts them, so that the timed ones find the cluster as a running one would be.
                _prepare(corpus, dataclasses.replace(spec, max_bytes=WARMUP_TEXT), tok,
                         os.path.join(work, "warm-up"), True, cores)
            speeds: dict[str, list[float]] = {"ray_data": [], "single": []}
            manifests: dict[str, dict] = {}
            for r in range(prep_rounds):
                for mode in (["ray_data", "single"] if r % 2 == 0 else ["single", "ray_data"]):
                    dest = os.path.join(work, f"shards-{mode}-{r}")
                    mb_s, manifests[mode] = _prepare(corpus, spec, tok, dest, mode == "ray_data", cores)
                    speeds[mode].append(mb_s)
                say(f"prepare round {r + 1}: MB/s Ray Data {speeds['ray_data'][-1]:.2f}, single "
                    f"{speeds['single'][-1]:.2f}")
            if manifests["ray_data"] != manifests["single"]:
                raise RuntimeError("the Ray Data pipeline and the single-process preparation wrote different shards")
            ray_mb_s, single_mb_s = _median(speeds["ray_data"]), _median(speeds["single"])
            result.update({
                "prepare_ray_data_mb_s": round(ray_mb_s, 3), "prepare_single_mb_s": round(single_mb_s, 3),
                **_ratio("prepare_ratio", speeds["ray_data"], speeds["single"]),
                "prepare_parallelism": cores, "prepare_tokens": manifests["single"]["tokens"],
                "prepare_runs_mb_s": {k: [round(x, 3) for x in v] for k, v in speeds.items()}})
            parts_s["prepare"] = time.perf_counter() - started - sum(parts_s.values())

            say(f"(b) a cold epoch from S3 behind {latency_ms} ms per request: Ray Data read_parquet vs cs3's loader")
            result.update(_read_part(os.path.join(work, f"shards-ray_data-{prep_rounds - 1}"), work, latency_ms,
                                     read_rounds, say))
            parts_s["read"] = time.perf_counter() - started - sum(parts_s.values())

            say(f"(c) training {TRAIN_CONFIG}: data.loader ray_data vs direct, {train_rounds} rounds")
            result.update(_train_part(os.path.join(work, "runs"), train_rounds, warmup, steps, workers, say))
            parts_s["train"] = time.perf_counter() - started - sum(parts_s.values())
        result |= {"targets": TARGETS, "verdicts": stats.judge(result, TARGETS), "method": stats.METHOD}
        result["parts_wall_s"] = {k: round(v, 1) for k, v in parts_s.items()}
        result["wall_s"] = round(time.perf_counter() - started, 1)
        return result
    finally:
        shutil.rmtree(work, ignore_errors=True)


JSON_KEYS = ("prepare_ray_data_mb_s", "prepare_single_mb_s", "prepare_ratio", "ray_data_read_mb_s", "cs3_cold_mb_s",
             "cs3_warm_mb_s", "ray_data_loader_ratio")


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: measure, Ray Data's figure, the other's, ratio, target."""
    def met(key: str) -> str:
        return f"{stats.stated(r['targets'][key])}: {r['verdicts'][key]}"

    return [
        ("(a) prepare MB/s: pipeline | 1 process", r["prepare_ray_data_mb_s"], r["prepare_single_mb_s"],
         stats.shown(r, "prepare_ratio", 3), met("prepare_ratio")),
        ("(b) cold epoch MB/s: read_parquet | cs3", r["ray_data_read_mb_s"], r["cs3_cold_mb_s"],
         stats.shown(r, "cold_over_ray_data_read", 3), met("cold_over_ray_data_read")),
        ("(b) warm epoch MB/s: cs3 (L2)", "", r["cs3_warm_mb_s"], "", ""),
        ("(c) tokens/s: loader ray_data | direct", r["ray_data_tokens_per_s"], r["direct_tokens_per_s"],
         stats.shown(r, "ray_data_loader_ratio", 3), met("ray_data_loader_ratio")),
    ]

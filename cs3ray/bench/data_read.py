"""`cs3 bench data` part (b): one epoch of a shard set at a size that matters, from a loopback S3 store.

The shard set: `mb` MB of uniform random token ids (they do not compress, so the bytes moved are the
bytes counted) in cs3ray's own shard format, `data.samples_per_shard` samples of seq_len+1 ids per
shard as `cs3 data prepare` writes them, put straight on a moto S3 server. Readers reach it through
the latency proxy of `bench cache`, run in a process of its own whose CPU time (and moto's) is
measured per epoch, so the endpoint is shown not to be what limits the figures.

Both sides use one filesystem implementation: s3fs with cs3ray's storage options; Ray Data's
`read_parquet` gets the same s3fs wrapped as a pyarrow filesystem (`PyFileSystem(FSSpecHandler)`).
Ray Data runs at the best of a few read settings; cs3ray's loader (`TrainStream`: the exact global
order through the tiered cache) reads with an empty L2 (cold) and again with that L2 (warm).

Startup apart from steady state: a reader may deliver its first rows only after most of its reading
(a few large read tasks do), so the time to the first batch does not separate them. Each reader
instead reads, in every round, the whole set and a part of it (a quarter of the shards, a set of its
own), each to the end: the steady rate is the extra MB over the extra seconds, the startup what the
whole epoch took beyond its MB at that rate (a line through the two points: T = startup + MB / rate).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import statistics
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterator

import numpy as np

from cs3ray.config.schema import CacheConfig, DataConfig
from cs3ray.data.ray_settings import ray_data_settings
from cs3ray.data.shards import FORMAT_VERSION, MANIFEST, TOKEN_COLUMN, decode_tokens, encode_shard
from cs3ray.data.stream import TrainStream
from cs3ray.storage import Storage, open_url

from . import stats
from .loopback_s3 import MotoServer, ProxyProcess, make_bucket, s3_options
from .usage import CpuShare

BUCKET = "cs3"
MB = 2**20
BATCH = 256  # rows per batch on both sides: Ray Data's default batch_size
SAMPLES_PER_SHARD = DataConfig.model_fields["samples_per_shard"].default  # what `cs3 data prepare` writes
VAL_SAMPLES = 16  # a manifest needs a val split; nothing reads it here
USE_V2 = "use_datasource_v2"  # a DataContext setting among read_parquet's arguments tried
PART_SHARE = 0.25  # the part-sized read: this share of the shards (Ray Data's settings are tried on it and half of it)


@dataclass(frozen=True)
class Epoch:
    """One read to the end: the time to its first batch, its whole time, its rows."""

    first_batch_s: float
    total_s: float
    rows: int


@dataclass(frozen=True)
class Fit:
    """A reader in one round, from a whole epoch of `mb` and a part-sized one: T = startup_s + MB / steady_mb_s."""

    startup_s: float
    steady_mb_s: float
    mb_s: float  # the whole epoch's MB over its whole time
    first_batch_s: float  # the whole epoch's


def fit(part: Epoch, part_mb: float, whole: Epoch, mb: float) -> Fit:
    """The line through (part_mb, part's time) and (mb, whole's time); where timing noise makes it fall or cross
    below zero, no startup is claimed and the steady rate is the whole epoch's (a lower bound)."""
    dt = whole.total_s - part.total_s
    steady = (mb - part_mb) / dt if dt > 0 else 0.0
    startup = whole.total_s - mb / steady if steady > 0 else -1.0
    if startup < 0:
        startup, steady = 0.0, mb / whole.total_s
    return Fit(startup, steady, mb / whole.total_s, whole.first_batch_s)


def _timed(batches: Iterator[int], t0: float) -> Epoch:
    """Drain `batches` (rows per batch), started at `t0`."""
    first, rows = 0.0, 0
    for n in batches:
        if rows == 0:
            first = time.perf_counter() - t0
        rows += n
    return Epoch(first, time.perf_counter() - t0, rows)


def _manifest(seq_len: int, train: list[dict], val: list[dict]) -> dict:
    samples = {"val": sum(e["samples"] for e in val), "train": sum(e["samples"] for e in train)}
    return {"format_version": FORMAT_VERSION, "source": "synthetic: uniform random uint16 token ids",
            "tokenizer": None, "seq_len": seq_len, "dtype": "uint16", "splits": {"val": val, "train": train},
            "samples": samples, "tokens": (samples["val"] + samples["train"]) * (seq_len + 1),
            "key": f"synthetic-{seq_len}-{len(train)}"}


def synthesize(dest: Storage, part: Storage, mb: float, seq_len: int, samples_per_shard: int = SAMPLES_PER_SHARD,
               threads: int = 4) -> tuple[dict, dict]:
    """At least `mb` MB of train shards of random token ids (and a small val shard) under `dest`, the first quarter
    of them again under `part` (a shard set of its own), written in parallel, manifests last; returns both."""
    width = seq_len + 1
    shards = max(4, math.ceil(mb * MB / (samples_per_shard * width * 2)))
    in_part = max(2, round(shards * PART_SHARE))

    def shard(i: int, name: str, rows: int, stores: tuple[Storage, ...]) -> dict:
        # Uniform ids over 16 bits do not compress: the bytes moved are the bytes counted.
        samples = np.random.default_rng(i).integers(0, 2**16, size=(rows, width), dtype=np.uint16)
        entry, data = encode_shard(name, samples)
        for store in stores:
            store.write_bytes(data, name)
        return entry

    with ThreadPoolExecutor(threads) as pool:
        train = list(pool.map(lambda i: shard(i, f"train-{i:05d}.parquet", samples_per_shard,
                                              (dest, part) if i < in_part else (dest,)), range(shards)))
    val = [shard(shards, "val-00000.parquet", VAL_SAMPLES, (dest, part))]
    manifests = _manifest(seq_len, train, val), _manifest(seq_len, train[:in_part], val)
    for store, manifest in zip((dest, part), manifests, strict=True):
        store.write_text(json.dumps(manifest, indent=1), MANIFEST)
    return manifests


@contextlib.contextmanager
def quiet_ray_data() -> Iterator[None]:
    """Ray Data under cs3ray's settings (no progress bars or info lines to bury the bench's own), restored after."""
    with ray_data_settings(), warnings.catch_warnings():  # e.g. a concurrency above the read tasks a small set makes
        warnings.filterwarnings("ignore", category=UserWarning, module=r"ray\.data")
        yield


def ray_data_tries(cores: int) -> dict[str, Callable[[int], dict[str, Any]]]:
    """read_parquet's settings tried, by name (each a function of the file count): its defaults, and its file-based
    datasource (`DataContext.use_datasource_v2 = False`; Ray 2.60's default packs files into few large read tasks
    whose first rows come after a listing task) with a block per file at one task per core, and at 4 tasks per
    core of a quarter CPU each (reads wait on the network more than they compute)."""
    return {"defaults": lambda files: {},
            f"use_datasource_v2=False, override_num_blocks=files, concurrency={cores}":
                lambda files: {USE_V2: False, "override_num_blocks": files, "concurrency": cores},
            f"use_datasource_v2=False, override_num_blocks=files, concurrency={4 * cores}, num_cpus=0.25":
                lambda files: {USE_V2: False, "override_num_blocks": files, "concurrency": 4 * cores,
                               "num_cpus": 0.25}}


def ray_data_epoch(paths: list[str], fs: Any, samples: int, settings: dict[str, Any]) -> Epoch:
    """Ray Data's `read_parquet` delivering every row of `paths` as token micro-batches; `settings` are its
    arguments, and `use_datasource_v2` (when there) the DataContext's for this epoch."""
    import ray.data

    args = dict(settings)
    ctx = ray.data.DataContext.get_current()
    saved = ctx.use_datasource_v2
    ctx.use_datasource_v2 = args.pop(USE_V2, saved)
    try:
        t0 = time.perf_counter()
        ds = ray.data.read_parquet(paths, filesystem=fs, **args)
        epoch = _timed((len(decode_tokens(b[TOKEN_COLUMN]))
                        for b in ds.iter_batches(batch_size=BATCH, batch_format="numpy")), t0)
    finally:
        ctx.use_datasource_v2 = saved
    if epoch.rows != samples:
        raise RuntimeError(f"Ray Data's read_parquet delivered {epoch.rows} rows of the {samples} in the shards")
    return epoch


def cs3_epoch(url: str, options: dict, l2: str, samples: int) -> Epoch:
    """One rank's epoch of cs3ray's loader (the exact global order) through the tiered cache with L2 at `l2`."""
    t0 = time.perf_counter()
    stream = TrainStream(BATCH, seed=0, shards_url=url, storage_options=options,
                         cache=CacheConfig(disk_dir=l2).model_dump(), rank=0, world=1)
    try:
        epoch = _timed((len(next(stream)) for _ in range(samples // BATCH)), t0)
    finally:
        stream.close()
    if epoch.rows != samples // BATCH * BATCH:
        raise RuntimeError(f"cs3ray's loader delivered {epoch.rows} rows of {samples // BATCH * BATCH}")
    return epoch


class _Endpoint:
    """The proxy's and moto's CPU share over each epoch run through `measure`, the highest per reader kept."""

    def __init__(self, proxy: ProxyProcess, moto: MotoServer) -> None:
        self.proxy, self.meters = proxy, {"proxy": CpuShare(proxy.pid), "s3_server": CpuShare(moto.proc.pid)}
        self.cpu: dict[str, dict[str, float]] = {k: {} for k in self.meters}
        self.requests: dict[str, int] = {}

    def measure(self, reader: str, epoch: Callable[[], Epoch], count: bool = True) -> Epoch:
        """Run `epoch()`; with `count`, the requests of `reader`'s first such epoch are kept too."""
        before = self.proxy.requests
        for meter in self.meters.values():
            meter.start()
        result = epoch()
        for name, meter in self.meters.items():
            self.cpu[name][reader] = round(max(self.cpu[name].get(reader, 0.0), meter.fraction()), 3)
        if count:
            self.requests.setdefault(reader, self.proxy.requests - before)
        return result


def _figures(name: str, fits: list[Fit]) -> dict[str, Any]:
    """A reader's medians over the rounds: whole-epoch MB/s, steady MB/s, startup and first-batch seconds."""
    def median(key: str) -> float:
        return round(statistics.median(getattr(f, key) for f in fits), 3)

    return {f"{name}_mb_s": median("mb_s"), f"{name}_steady_mb_s": median("steady_mb_s"),
            f"{name}_startup_s": median("startup_s"), f"{name}_first_batch_s": median("first_batch_s")}


def _ratio(name: str, ours: list[Fit], theirs: list[Fit], key: str) -> dict[str, Any]:
    return stats.summarize(name, [round(getattr(a, key) / getattr(b, key), 4) for a, b in zip(ours, theirs, strict=True)])


def filesystem_label() -> str:
    import pyarrow
    import s3fs

    return (f"s3fs {s3fs.__version__} with cs3ray's storage options on both sides (Ray Data: that s3fs as "
            f"pyarrow.fs.PyFileSystem(FSSpecHandler), pyarrow {pyarrow.__version__})")


def _shown(f: Fit) -> str:
    return f"{f.steady_mb_s:.1f} ({f.startup_s:.1f})"


def _try_settings(endpoint: _Endpoint, settings: dict[str, Callable[[int], dict[str, Any]]], paths: list[str],
                  fs: Any, part: list[dict], fitted: bool, say: Callable[[str], None]) -> dict[str, dict[str, float]]:
    """Each of Ray Data's settings on the part-sized set's shards: with `fitted`, also on half of them, for its
    steady rate and startup; else (a smoke run) that one read's MB/s."""
    sizes = [max(1, len(part) // 2), len(part)] if fitted else [len(part)]
    tried: dict[str, dict[str, float]] = {}
    for name, make in settings.items():
        reads = []
        for k in sizes:
            epoch = partial(ray_data_epoch, paths[:k], fs, sum(e["samples"] for e in part[:k]), make(k))
            reads.append((endpoint.measure("ray_data", epoch, False), sum(e["bytes"] for e in part[:k]) / MB))
        (small, small_mb), (big, big_mb) = reads[0], reads[-1]
        tried[name] = {"mb_s": round(big_mb / big.total_s, 2)}
        line = f"{tried[name]['mb_s']:.1f} MB/s"
        if fitted:
            f = fit(small, small_mb, big, big_mb)
            tried[name] |= {"steady_mb_s": round(f.steady_mb_s, 2), "startup_s": round(f.startup_s, 3)}
            line = f"{f.steady_mb_s:.1f} MB/s steady, startup {f.startup_s:.1f} s"
        say(f"Ray Data read_parquet, {name}: {line} ({' and '.join(map(str, sizes))} shards)")
    return tried


def read_part(mb: float, seq_len: int, latency_ms: float, rounds: int, cores: int, work: str,
              say: Callable[[str], None], fitted: bool = True) -> dict[str, Any]:
    """(b): synthesize the set on a loopback S3 store, try Ray Data's settings, then `rounds` rounds of Ray Data
    at its best against cs3ray's cold and warm epochs (each round in the other order), every reader reading the
    part-sized set and the whole one. `fitted`: the settings are ranked by their fitted steady rate (two reads
    each), else by one read's MB/s (a smoke run)."""
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    moto, proxy = MotoServer(), None
    try:
        make_bucket(moto.url, BUCKET)
        t0 = time.perf_counter()
        direct = s3_options(moto.url)
        whole, part = synthesize(open_url(f"s3://{BUCKET}/data", direct), open_url(f"s3://{BUCKET}/part", direct),
                                 mb, seq_len)
        train, n = whole["splits"]["train"], len(part["splits"]["train"])
        size, part_mb = sum(e["bytes"] for e in train) / MB, sum(e["bytes"] for e in train[:n]) / MB
        samples, part_samples = whole["samples"]["train"], part["samples"]["train"]
        say(f"wrote {size:.0f} MB of random tokens in {len(train)} shards of {size / len(train):.1f} MB to loopback "
            f"S3 in {time.perf_counter() - t0:.0f} s (not timed); the part-sized set: {n} of them")
        proxy = ProxyProcess(moto.url, latency_ms / 1000)
        endpoint = _Endpoint(proxy, moto)
        options = s3_options(proxy.url)
        urls = {"whole": f"s3://{BUCKET}/data", "part": f"s3://{BUCKET}/part"}
        fs = PyFileSystem(FSSpecHandler(open_url(urls["whole"], options).fs))  # the very client cs3ray's storage makes
        paths = [f"{BUCKET}/data/{e['file']}" for e in train]
        settings = ray_data_tries(cores)
        with quiet_ray_data():
            tried = _try_settings(endpoint, settings, paths, fs, train[:n], fitted, say)
            rank = "steady_mb_s" if fitted else "mb_s"
            best = max(tried, key=lambda k: tried[k][rank])
            runs: dict[str, list[Fit]] = {"ray_data": [], "cs3_cold": [], "cs3_warm": []}
            for r in range(rounds):
                # Each round in the other order, so a drift of the host's speed reaches both alike.
                for mode in (["ray_data", "cs3"] if r % 2 == 0 else ["cs3", "ray_data"]):
                    if mode == "ray_data":
                        small = endpoint.measure("ray_data", partial(ray_data_epoch, paths[:n], fs, part_samples,
                                                                     settings[best](n)), False)
                        big = endpoint.measure("ray_data", partial(ray_data_epoch, paths, fs, samples,
                                                                   settings[best](len(paths))))
                        runs["ray_data"].append(fit(small, part_mb, big, size))
                        continue
                    epochs: dict[str, dict[str, Epoch]] = {"cs3_cold": {}, "cs3_warm": {}}
                    for which, count in (("part", part_samples), ("whole", samples)):
                        l2 = os.path.join(work, f"l2-{which}-{r}")
                        for reader in ("cs3_cold", "cs3_warm"):  # the first fills the L2 the second reads
                            epochs[reader][which] = endpoint.measure(
                                reader, partial(cs3_epoch, urls[which], options, l2, count), which == "whole")
                        shutil.rmtree(l2, ignore_errors=True)
                    for reader, e in epochs.items():
                        runs[reader].append(fit(e["part"], part_mb, e["whole"], size))
                say(f"read round {r + 1}, steady MB/s (startup s): Ray Data {_shown(runs['ray_data'][-1])}, "
                    f"cs3 cold {_shown(runs['cs3_cold'][-1])}, warm {_shown(runs['cs3_warm'][-1])}")
        ray, cold, warm = runs["ray_data"], runs["cs3_cold"], runs["cs3_warm"]
        ray_figures = _figures("ray_data", ray)
        return {
            "dataset_mb": round(size, 1), "shards_mb": round(size, 2), "train_shards": len(train),
            "train_samples": samples, "read_seq_len": seq_len, "read_samples_per_shard": SAMPLES_PER_SHARD,
            "shard_mb": round(size / len(train), 2), "read_part_shards": n, "latency_ms": latency_ms,
            "read_rounds": rounds, "batch_rows": BATCH, "filesystem": filesystem_label(),
            "ray_data_settings_tried": tried, "ray_data_settings_ranked_by": rank, "ray_data_best": best, "ray_data_best_args": settings[best](len(paths)),
            "ray_data_read_mb_s": ray_figures.pop("ray_data_mb_s"), **ray_figures,
            **_figures("cs3_cold", cold), **_figures("cs3_warm", warm),
            # Per round: cs3ray's figure over read_parquet's, read back to back with it.
            **_ratio("cold_over_ray_data_read", cold, ray, "mb_s"),
            **_ratio("cold_steady_over_ray_data", cold, ray, "steady_mb_s"),
            **_ratio("warm_steady_over_ray_data", warm, ray, "steady_mb_s"),
            # The endpoint's worst epoch: a share of one core near 1 would make it the bottleneck.
            **stats.exact("proxy_cpu_fraction", max(endpoint.cpu["proxy"].values())),
            "s3_server_cpu_fraction": max(endpoint.cpu["s3_server"].values()), "endpoint_cpu_fraction": endpoint.cpu,
            "s3_requests_per_epoch": endpoint.requests,
            **{f"read_runs_{key}": {k: [round(getattr(f, key), 3) for f in v] for k, v in runs.items()}
               for key in ("mb_s", "steady_mb_s", "startup_s", "first_batch_s")}}
    finally:
        if proxy is not None:
            proxy.stop()
        moto.stop()

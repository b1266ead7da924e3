"""`cs3 bench data`: Ray Data in cs3ray's data path against its peers, in one run and one Ray cluster.

(a) prepare: the Ray Data pipeline (`prepare_shards_ray`, one task per core) against the
    single-process `prepare_shards` (the tokenizer's own threads on every core), the same corpus
    and byte-level BPE, each timed from the first read to the manifest written; their outputs
    must be identical. MB/s of source text, and per core; the bench process's peak RSS growth
    while the pipeline prepares (what its driver holds).
(b) read (`data_read`): one epoch of a synthesized shard set of `read_mb` MB in cs3ray's shard format
    from a moto S3 server behind a latency proxy in its own process (its CPU share measured),
    through the same s3fs client on both sides: Ray Data's `read_parquet` at the best of a few
    settings against cs3ray's loader (`TrainStream`, the exact global order through the tiered
    cache) cold (empty L2) and warm; startup apart from steady-state MB/s of shard bytes.
(c) train: tokens/s of configs/tiny.yaml with `data.loader=ray_data` against `data.loader=direct`,
    taking turns (each round in the other order); the ratio is the median of the rounds' ratios.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import statistics
import sysconfig
import tempfile
import time
from typing import Any, Callable, Iterator

from cs3ray.config import load_config
from cs3ray.data import ShardSpec, open_corpus, prepare_shards, prepare_shards_ray, train_tokenizer
from cs3ray.data.corpus import STDLIB, Corpus
from cs3ray.data.peak_rss import PeakRss
from cs3ray.models import load_tokenizer
from cs3ray.ops.cluster import ray_cluster
from cs3ray.storage import open_url
from cs3ray.train.driver import prepare_data

from . import stats
from .data_read import read_part
from .train import cs3_run

TRAIN_CONFIG = "configs/tiny.yaml"
VOCAB = 4096
TOKENIZER_TEXT = 4 * 2**20  # the slice of the standard library the BPE is trained on (not timed)
SEQ_LEN, SAMPLES_PER_SHARD = 128, 2048  # tiny.yaml's sample length; the config's default shard size
WARMUP_TEXT = 2**18
# (b)'s shard set: a sample of 2049 tokens (a 2048-token context, as large models train on) makes
# data.samples_per_shard's 2048 samples an 8 MB shard; --quick reads 1 MB shards.
READ_SEQ_LEN, QUICK_READ_SEQ_LEN, QUICK_READ_MB = 2048, 256, 16
NICENESS = "RAY_worker_niceness"  # read by an embedded cluster's raylet as it starts
TARGETS = {"prepare_ratio": {"at_least": 0.9}, "cold_over_ray_data_read": {"at_least": 1.0},
           "cold_steady_over_ray_data": {"at_least": 1.0}, "proxy_cpu_fraction": {"at_most": 0.5},
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


def _prepare(corpus: Corpus, spec: ShardSpec, tok: Any, dest: str, ray_data: bool,
             cores: int) -> tuple[float, dict, float]:
    """MB/s of source text, the manifest of one preparation into the empty folder `dest`, and this process's
    peak RSS growth (MB) meanwhile."""
    chars = [0]

    def progress(n: int) -> None:
        chars[0] += n

    out = open_url(dest)
    t0 = time.perf_counter()
    with PeakRss() as rss:
        if ray_data:
            manifest = prepare_shards_ray(corpus, out, spec, progress, tok, parallelism=cores)[0]
        else:
            manifest = prepare_shards(corpus, out, spec, progress, tok)
    return chars[0] / 2**20 / (time.perf_counter() - t0), manifest, rss.growth_mb


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
        log: Callable[[str], None] | None = None, read_mb: int | None = None,
        read_seq_len: int | None = None) -> dict[str, Any]:
    """Run (a), (b) and (c); returns the issue's JSON keys, the context of each part and the targets.
    (b) reads `read_mb` MB (default 1024; --quick 16) in shards of samples of `read_seq_len`+1 tokens."""
    say = log or (lambda m: None)
    started = time.perf_counter()
    if quick:
        # One worker: a second one's start would double the smoke run's longest part. Preparing 1 MB (the BPE trained
        # on it too) and reading 16 MB take seconds, so they get the 2 rounds an interval needs; training keeps 1
        # (inconclusive).
        mb, prep_rounds, read_rounds, train_rounds, warmup, steps, workers = min(mb, 1), 2, 2, 1, 2, 4, 1
    else:
        prep_rounds, read_rounds, train_rounds, warmup, steps = 3, 3, 3, 5, 40
        workers = load_config(TRAIN_CONFIG).cluster.workers
    read_mb = read_mb or (QUICK_READ_MB if quick else 1024)
    read_seq_len = read_seq_len or (QUICK_READ_SEQ_LEN if quick else READ_SEQ_LEN)
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
            rss: dict[str, list[float]] = {"ray_data": [], "single": []}
            manifests: dict[str, dict] = {}
            for r in range(prep_rounds):
                for mode in (["ray_data", "single"] if r % 2 == 0 else ["single", "ray_data"]):
                    dest = os.path.join(work, f"shards-{mode}-{r}")
                    mb_s, manifests[mode], grew = _prepare(corpus, spec, tok, dest, mode == "ray_data", cores)
                    speeds[mode].append(mb_s)
                    rss[mode].append(grew)
                say(f"prepare round {r + 1}: MB/s Ray Data {speeds['ray_data'][-1]:.2f}, single "
                    f"{speeds['single'][-1]:.2f}")
            if manifests["ray_data"] != manifests["single"]:
                raise RuntimeError("the Ray Data pipeline and the single-process preparation wrote different shards")
            ray_mb_s, single_mb_s = _median(speeds["ray_data"]), _median(speeds["single"])
            result.update({
                "prepare_ray_data_mb_s": round(ray_mb_s, 3), "prepare_single_mb_s": round(single_mb_s, 3),
                # What a core adds: the pipeline runs a task per core, the one process its tokenizer's threads on each.
                "prepare_ray_data_mb_s_per_core": round(ray_mb_s / cores, 3),
                "prepare_single_mb_s_per_core": round(single_mb_s / cores, 3),
                # The driver's share of a preparation: the bench process's peak RSS growth while the pipeline ran
                # (the worst round), and while the single process prepared everything itself.
                "prepare_driver_peak_rss_mb": round(max(rss["ray_data"]), 1),
                "prepare_single_peak_rss_mb": round(max(rss["single"]), 1),
                **_ratio("prepare_ratio", speeds["ray_data"], speeds["single"]),
                "prepare_parallelism": cores, "prepare_tokens": manifests["single"]["tokens"],
                "prepare_runs_mb_s": {k: [round(x, 3) for x in v] for k, v in speeds.items()}})
            parts_s["prepare"] = time.perf_counter() - started - sum(parts_s.values())

            say(f"(b) an epoch of {read_mb} MB from S3 behind {latency_ms} ms per request: Ray Data read_parquet "
                f"vs cs3's loader, cold and warm")
            result.update(read_part(read_mb, read_seq_len, latency_ms, read_rounds, cores, work, say, fitted=not quick))
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
             "cs3_warm_mb_s", "ray_data_loader_ratio", "dataset_mb", "proxy_cpu_fraction", "cs3_cold_steady_mb_s",
             "ray_data_steady_mb_s", "prepare_driver_peak_rss_mb")


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: measure, Ray Data's figure, the other's, ratio, target."""
    def met(key: str) -> str:
        return f"{stats.stated(r['targets'][key])}: {r['verdicts'][key]}"

    return [
        ("(a) prepare MB/s: pipeline | 1 process", r["prepare_ray_data_mb_s"], r["prepare_single_mb_s"],
         stats.shown(r, "prepare_ratio", 3), met("prepare_ratio")),
        ("(a) prepare MB/s per core", r["prepare_ray_data_mb_s_per_core"], r["prepare_single_mb_s_per_core"], "", ""),
        ("(a) driver peak RSS growth, MB", r["prepare_driver_peak_rss_mb"], r["prepare_single_peak_rss_mb"], "", ""),
        ("(b) epoch MB/s: read_parquet | cs3 cold", r["ray_data_read_mb_s"], r["cs3_cold_mb_s"],
         stats.shown(r, "cold_over_ray_data_read", 3), met("cold_over_ray_data_read")),
        ("(b) steady MB/s: read_parquet | cs3 cold", r["ray_data_steady_mb_s"], r["cs3_cold_steady_mb_s"],
         stats.shown(r, "cold_steady_over_ray_data", 3), met("cold_steady_over_ray_data")),
        ("(b) steady MB/s: read_parquet | cs3 warm (L2)", r["ray_data_steady_mb_s"], r["cs3_warm_steady_mb_s"],
         stats.shown(r, "warm_steady_over_ray_data", 3), ""),
        ("(b) startup s: read_parquet | cs3 cold", r["ray_data_startup_s"], r["cs3_cold_startup_s"], "", ""),
        ("(b) endpoint CPU per wall s: proxy | moto", r["proxy_cpu_fraction"], r["s3_server_cpu_fraction"], "",
         met("proxy_cpu_fraction")),
        ("(c) tokens/s: loader ray_data | direct", r["ray_data_tokens_per_s"], r["direct_tokens_per_s"],
         stats.shown(r, "ray_data_loader_ratio", 3), met("ray_data_loader_ratio")),
    ]

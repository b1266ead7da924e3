"""Shard preparation on the cluster: corpus files are read and tokenized by a Ray Data pipeline on every
CPU of the cluster and the shards written by parallel Ray tasks, with output byte-identical to
`prepare_shards`. Only the files that can still be needed are tokenized (in waves), in groups of
about equal bytes.

Why the output does not depend on the cluster. Ray Data tasks read and tokenize whole corpus files
(a text file is one document, so a file is the smallest unit that keeps documents whole) and the
driver consumes their results in file order (`preserve_order`): the token stream is the same
concatenation of documents the single-process path makes, cut after the same document once
`max_bytes` of text is reached. Shard boundaries and the train/val split are a pure function of
the stream's length and the spec (`shard_plan`), and a shard's parquet bytes a pure function of
its samples, so the block layout, the number of tasks and the number of nodes change only where
the work runs, never what is written.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import logging
import os
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa

from cs3ray.models import ByteTokenizer, Tokenizer, tokenizer_from_json
from cs3ray.storage import Storage, StorageError

from .corpus import Corpus, DataError, SourceFile
from .shards import (
    BPE_BATCH,
    MANIFEST,
    ShardSpec,
    build_manifest,
    check_existing,
    encode_documents,
    encode_shard,
    shard_plan,
)

BLOCKS_PER_TASK = 4  # blocks per concurrent task: small blocks keep every CPU busy to the end


@functools.lru_cache(maxsize=2)
def _tokenizer(text: str) -> Tokenizer:
    # Ray reuses worker processes across tasks, so each builds a BPE tokenizer once, not per block.
    return tokenizer_from_json(text, "the preparation's tokenizer")


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Hugging Face tokenizers without its thread pool (of every core) inside: a task holds one CPU."""
    # The library reads this on every call, while the pool's size is fixed once a process has used it:
    # so it holds in a reused worker too, and the worker gets its setting back for whatever runs next.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _tokenize_files(batch: pa.Table, corpus: Corpus, tok_json: str) -> pa.Table:
    """Ray Data task: each group's corpus files -> their documents' character counts, token counts and tokens."""
    tok = _tokenizer(tok_json)
    rows: dict[str, list] = {"file": [], "chars": [], "lengths": [], "tokens": [], "error": []}
    groups = zip(*(batch.column(c).to_pylist() for c in ("files", "paths", "sizes")), strict=True)
    for i, path, size in ((i, p, n) for files, paths, sizes in groups for i, p, n in zip(files, paths, sizes,
                                                                                         strict=True)):
        texts, error = [], ""
        try:
            texts.extend(corpus.file_documents(SourceFile(path, size)))
        except DataError as exc:  # the driver raises it only if single-process preparation would reach it
            error = str(exc)
        except (OSError, pa.ArrowException) as exc:
            error = f"cannot read corpus file '{path}': {exc}"
        with _one_thread():
            docs = [d for s in range(0, len(texts), BPE_BATCH)
                    for d in encode_documents(texts[s:s + BPE_BATCH], tok)]
        rows["file"].append(i)
        rows["chars"].append(np.array([len(t) for t in texts], dtype=np.int64).tobytes())
        rows["lengths"].append(np.array([len(d) for d in docs], dtype=np.int64).tobytes())
        rows["tokens"].append(np.concatenate(docs).tobytes() if docs else b"")
        rows["error"].append(error)
    return pa.table({"file": pa.array(rows["file"], pa.int64()), "chars": pa.array(rows["chars"], pa.binary()),
                     "lengths": pa.array(rows["lengths"], pa.binary()),
                     "tokens": pa.array(rows["tokens"], pa.binary()), "error": pa.array(rows["error"], pa.string())})


def _groups(files: list[SourceFile], first: int, count: int) -> list[dict[str, list]]:
    """Consecutive files from `first` in `count` groups of about equal bytes (tasks of equal work, in order)."""
    sizes = np.array([f.size for f in files], dtype=np.int64)
    bounds = np.searchsorted(np.cumsum(sizes), np.arange(1, count) * sizes.sum() / count, side="left") + 1
    cuts = [0, *sorted({int(b) for b in bounds if 0 < b < len(files)}), len(files)]
    return [{"files": list(range(first + a, first + b)), "paths": [f.path for f in files[a:b]],
             "sizes": [f.size for f in files[a:b]]} for a, b in itertools.pairwise(cuts) if b > a]


def _write_shards(shards: list[tuple[int, str]], dest: Storage, samples: np.ndarray, plan_ids: list) -> list[dict]:
    """Ray task: write these shards (skipping files that already hold the same bytes)."""
    out = []
    for j, name in shards:
        entry, data = encode_shard(name, samples[plan_ids[j]])
        same, error = False, ""
        try:
            same = dest.exists(name) and hashlib.sha256(dest.read_bytes(name)).hexdigest() == entry["sha256"]
            if not same:
                dest.write_bytes(data, name)
        except StorageError as exc:  # one sentence on the driver, not a task traceback
            error = str(exc)
        out.append({"shard": j, "entry": entry, "skipped": same, "error": error})
    return out


def _write_all(plan: list, dest: Storage, samples: np.ndarray, workers: int,
               on_shards: Callable[[int, int], None] | None) -> list[dict]:
    """Every shard of `plan`, written by plain Ray tasks (a second Ray Data pipeline took seconds to start
    for work of a fraction of that); results in shard order."""
    import ray

    names = [(j, name) for j, (_, name, _) in enumerate(plan)]
    # One task per CPU the tokenize stage used: its worker processes are warm, while every task beyond
    # them would start (and import cs3ray into) a new process, which costs more than a shard's writing.
    chunks = [names[i::workers] for i in range(min(len(names), workers))]
    options: dict[str, Any] = {"num_cpus": 1}
    if _is_local(dest):  # a local path exists on the driver's machine only
        options["label_selector"] = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    else:
        options["scheduling_strategy"] = "SPREAD"
    task = ray.remote(_write_shards).options(**options)
    samples_ref, ids_ref = ray.put(samples), ray.put([ids for _, _, ids in plan])
    pending = [task.remote(c, dest, samples_ref, ids_ref) for c in chunks]
    rows: list[dict] = []
    while pending:
        done, pending = ray.wait(pending, num_returns=1)
        rows.extend(ray.get(done[0]))
        if on_shards:
            on_shards(len(rows), len(names))
    return sorted(rows, key=lambda r: r["shard"])


def _is_local(storage: Storage) -> bool:
    protocol = storage.fs.protocol
    return "file" in (protocol if isinstance(protocol, (tuple, list)) else (protocol,))


def _placement(local: bool, parallelism: int) -> dict[str, Any]:
    """map_batches arguments: at most `parallelism` tasks at once; a local path exists on the driver's
    machine only, so its tasks run there, while URLs are read and written from every node."""
    import ray

    args: dict[str, Any] = {"compute": ray.data.TaskPoolStrategy(size=parallelism)}
    if local:
        args["label_selector"] = {"ray.io/node-id": ray.get_runtime_context().get_node_id()}
    return args


@contextlib.contextmanager
def _ordered(progress_bars: bool) -> Iterator[None]:
    """Ray Data settings of this preparation: results in input order; Ray Data's bars and its per-dataset
    log lines only when asked (the caller shows progress through its callbacks otherwise)."""
    import ray

    ctx = ray.data.DataContext.get_current()
    logger = logging.getLogger("ray.data")
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars, logger.level
    ctx.execution_options.preserve_order, ctx.enable_progress_bars = True, progress_bars
    if not progress_bars:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved[:2]
        logger.setLevel(saved[2])


def _token_stream(corpus: Corpus, tok: Tokenizer, max_bytes: int, progress: Callable[[int], None] | None,
                  parallelism: int) -> np.ndarray:
    """The tokens of the corpus' documents in order, up to the document that reaches `max_bytes` of text.

    Only the files that can still be needed are tokenized: a wave takes the next files up to a tenth more
    bytes than the text still missing (a character is at least one byte of a text file), and another
    wave follows only if their documents fell short.
    """
    import ray

    args = {"corpus": dataclasses.replace(corpus, files=[]), "tok_json": tok.to_json()}
    placement = _placement(_is_local(corpus.storage), parallelism)
    parts: list[np.ndarray] = []
    produced, first = 0, 0
    while first < len(corpus.files):
        want = (max_bytes - produced) * 1.1
        stop = min(len(corpus.files),
                   first + 1 + int(np.searchsorted(np.cumsum([f.size for f in corpus.files[first:]]), want)))
        groups = _groups(corpus.files[first:stop], first, BLOCKS_PER_TASK * parallelism)
        ds = ray.data.from_items(groups, override_num_blocks=len(groups))
        ds = ds.map_batches(_tokenize_files, batch_size=None, batch_format="pyarrow", fn_kwargs=args,
                            num_cpus=1, **placement)  # one CPU: the one thread its tokenizer uses (`_one_thread`)
        for batch in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
            for row in batch.to_pylist():
                chars = np.frombuffer(row["chars"], dtype=np.int64)
                lengths = np.frombuffer(row["lengths"], dtype=np.int64)
                reached = np.nonzero(produced + np.cumsum(chars) >= max_bytes)[0]
                docs = int(reached[0]) + 1 if len(reached) else len(chars)
                parts.append(np.frombuffer(row["tokens"], dtype=np.uint16)[: int(lengths[:docs].sum())])
                produced += int(chars[:docs].sum())
                if progress:
                    progress(int(chars[:docs].sum()))
                if produced >= max_bytes:
                    return np.concatenate(parts)
                if row["error"]:
                    raise DataError(row["error"])
        first = stop
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.uint16)


def _verified(dest: Storage, manifest: dict) -> bool:
    try:
        return all(dest.exists(e["file"]) and hashlib.sha256(dest.read_bytes(e["file"])).hexdigest() == e["sha256"]
                   for entries in manifest["splits"].values() for e in entries)
    except StorageError:
        return False


def prepare_shards_ray(corpus: Corpus, dest: Storage, spec: ShardSpec, progress: Callable[[int], None] | None = None,
                       tokenizer: Tokenizer | None = None, parallelism: int | None = None,
                       progress_bars: bool = False,
                       on_shards: Callable[[int, int], None] | None = None) -> tuple[dict, int]:
    """`prepare_shards` on the connected Ray cluster; returns (manifest, shards already there and left alone).

    parallelism: concurrent tasks per stage (default: the cluster's CPUs); it never changes the output.
    progress: characters of text tokenized so far, as they arrive; on_shards: (shards written, of total).
    """
    import ray

    tok = tokenizer or ByteTokenizer()
    existing = check_existing(dest, tok)
    if existing and existing.get("key") == spec.key(corpus, tok) and _verified(dest, existing):
        return existing, sum(len(v) for v in existing["splits"].values())
    workers = max(1, parallelism or int(ray.cluster_resources().get("CPU", 1)))
    with _ordered(progress_bars):
        tokens = _token_stream(corpus, tok, spec.max_bytes, progress, workers)
    plan = shard_plan(len(tokens), corpus.spec, spec)
    width = spec.seq_len + 1
    rows = _write_all(plan, dest, tokens[: len(tokens) // width * width].reshape(-1, width), workers, on_shards)
    failed = next((r["error"] for r in rows if r["error"]), None)
    if failed:
        raise StorageError(failed)
    manifest = build_manifest(corpus, spec, tok, len(tokens), plan, [r["entry"] for r in rows])
    dest.write_text(json.dumps(manifest, indent=1), MANIFEST)
    return manifest, sum(1 for r in rows if r["skipped"])

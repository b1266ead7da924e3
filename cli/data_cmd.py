"""`cs3 data prepare`: turn a corpus into token shards with a manifest; `cs3 data tokenizer`: train a BPE on one."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TaskProgressColumn, TextColumn, TimeRemainingColumn

from .common import AddressOpt, StorageOptionsOpt, StorageOverridesArg, console, user_errors

app = typer.Typer(help="Prepare training data.", no_args_is_help=True)


@app.command("prepare")
@user_errors
def prepare(src: str = typer.Argument(..., help="Corpus: 'python-stdlib', a dir/file or an fsspec URL."),
            dest: str = typer.Argument(..., help="Output folder (local path or fsspec URL)."),
            seq_len: int = typer.Option(128, min=8, help="Tokens per training sample."),
            max_bytes: int = typer.Option(32_000_000, min=1000, help="Read at most this many bytes of text."),
            samples_per_shard: int = typer.Option(2048, min=16, help="Samples per parquet shard."),
            val_fraction: float = typer.Option(0.02, min=0.0001, max=0.5, help="Share held out for validation."),
            fmt: str = typer.Option("auto", "--format", help="auto | text | parquet | jsonl."),
            text_column: str = typer.Option("text", help="Text column of parquet/jsonl sources."),
            seed: int = typer.Option(0, help="Seed of the train/validation split."),
            tokenizer: str = typer.Option("byte", help="'byte', or a local tokenizer.json / folder holding one."),
            parallelism: Optional[int] = typer.Option(None, min=1, help="Concurrent Ray Data tasks per stage "
                                                                          "(default: the cluster's CPUs); the output "
                                                                          "is the same for any value."),
            piece_bytes: Optional[int] = typer.Option(None, min=1024, help="Read files larger than this in parts "
                                                                          "of about this size (default: automatic); "
                                                                          "the output is the same for any value."),
            address: Optional[str] = AddressOpt,
            storage: Optional[list[str]] = StorageOverridesArg,
            storage_options: Optional[str] = StorageOptionsOpt,
            as_json: bool = typer.Option(False, "--json", help="Print the manifest summary as JSON.")) -> None:
    """Tokenize SRC into fixed-length parquet shards plus manifest.json under DEST with a Ray Data pipeline."""
    from cs3ray.config import runtime_storage_options
    from cs3ray.data import ShardSpec, open_corpus, prepare_shards_ray
    from cs3ray.models import load_tokenizer
    from cs3ray.ops.cluster import ray_cluster
    from cs3ray.storage import open_url

    if fmt not in ("auto", "text", "parquet", "jsonl"):
        raise typer.BadParameter(f"--format {fmt!r} is not one of auto, text, parquet, jsonl")
    options = runtime_storage_options(storage or [], storage_options)
    tok = load_tokenizer(tokenizer)
    corpus = open_corpus(src, fmt, text_column, options)
    out = open_url(dest, options)
    with ray_cluster(address, quiet=True), \
            Progress(TextColumn("{task.description}"), BarColumn(), TaskProgressColumn(), TimeRemainingColumn(),
                     console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("tokenizing", total=max_bytes)

        def shards_done(done: int, total: int) -> None:
            bar.update(task, description="writing shards", completed=done, total=total)

        manifest, kept, peak_mb = prepare_shards_ray(corpus, out, ShardSpec(seq_len, samples_per_shard, val_fraction,
                                                                            max_bytes, seed),
                                                     progress=lambda n: bar.advance(task, n), tokenizer=tok,
                                                     parallelism=parallelism, on_shards=shards_done,
                                                     piece_bytes=piece_bytes)
    summary = {"dest": out.url, "tokens": manifest["tokens"], "samples": manifest["samples"],
               "shards": {k: len(v) for k, v in manifest["splits"].items()}, "shards_kept": kept,
               "driver_peak_rss_mb": peak_mb}
    if as_json:
        print(json.dumps(summary))
    else:
        shards = summary["shards"]["train"] + summary["shards"]["val"]
        kept_note = f" ({kept} already there and verified, left alone)" if kept else ""
        console.print(f"prepared {summary['samples']['train']} train and {summary['samples']['val']} validation "
                      f"samples ({summary['tokens']:,} tokens) in {shards} shards{kept_note} at {out.url}")


@app.command("tokenizer")
@user_errors
def tokenizer_cmd(src: str = typer.Argument(..., help="Corpus: 'python-stdlib', a dir/file or an fsspec URL."),
                  vocab: int = typer.Option(..., "--vocab", help="Ids in the tokenizer, specials included "
                                                                 "(259..65536)."),
                  out: str = typer.Option(..., "--out", help="Folder that gets tokenizer.json."),
                  max_bytes: int = typer.Option(32_000_000, min=1000, help="Train on at most this many bytes of text."),
                  fmt: str = typer.Option("auto", "--format", help="auto | text | parquet | jsonl."),
                  text_column: str = typer.Option("text", help="Text column of parquet/jsonl sources."),
                  as_json: bool = typer.Option(False, "--json", help="Print the summary as JSON.")) -> None:
    """Train a byte-level BPE tokenizer on SRC and write OUT/tokenizer.json (use it as data.tokenizer=OUT)."""
    from cs3ray.data import DataError, train_tokenizer

    if fmt not in ("auto", "text", "parquet", "jsonl"):
        raise DataError(f"--format {fmt!r} is not one of auto, text, parquet, jsonl.")
    with Progress(TextColumn("training"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("train", total=max_bytes)
        summary = train_tokenizer(src, vocab, out, fmt, text_column, max_bytes,
                                  progress=lambda n: bar.advance(task, n))
    if as_json:
        print(json.dumps(summary))
    else:
        console.print(f"trained {summary['tokenizer']} on {summary['documents']} documents "
                      f"({summary['bytes']:,} characters): {summary['path']}")

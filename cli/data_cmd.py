"""`cs3 data prepare`: turn a corpus into token shards with a manifest; `cs3 data tokenizer`: train a BPE on one."""

from __future__ import annotations

import json

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

from cs3ray.data import DataError, ShardSpec, open_corpus, prepare_shards, train_tokenizer
from cs3ray.models import load_tokenizer
from cs3ray.storage import open_url

from .common import console, user_errors

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
            as_json: bool = typer.Option(False, "--json", help="Print the manifest summary as JSON.")) -> None:
    """Tokenize SRC into fixed-length parquet shards plus manifest.json under DEST."""
    if fmt not in ("auto", "text", "parquet", "jsonl"):
        raise typer.BadParameter(f"--format {fmt!r} is not one of auto, text, parquet, jsonl")
    tok = load_tokenizer(tokenizer)
    corpus = open_corpus(src, fmt, text_column)
    out = open_url(dest)
    with Progress(TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn(),
                  console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("tok", total=max_bytes)
        manifest = prepare_shards(corpus, out, ShardSpec(seq_len, samples_per_shard, val_fraction, max_bytes, seed),
                                  progress=lambda n: bar.advance(task, n), tokenizer=tok)
    summary = {"dest": out.url, "tokens": manifest["tokens"], "samples": manifest["samples"],
               "shards": {k: len(v) for k, v in manifest["splits"].items()}}
    if as_json:
        print(json.dumps(summary))
    else:
        console.print(f"prepared {summary['samples']['train']} train and {summary['samples']['val']} validation "
                      f"samples ({summary['tokens']:,} tokens) in {summary['shards']['train'] + summary['shards']['val']} "
                      f"shards at {out.url}")


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

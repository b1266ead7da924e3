"""`cs3 ckpt ls|verify|export|import-hf`: inspect, check and export a run's checkpoints; import Hugging Face Llama."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import (
    JsonOpt,
    ReplicaOpt,
    StorageOptionsOpt,
    StorageOverridesArg,
    StoredReplicasOpt,
    console,
    err_console,
    note,
    user_errors,
)

app = typer.Typer(help="Checkpoints of a run: list them, verify checksums, export one file, import Hugging Face Llama.",
                  no_args_is_help=True)


@app.command("ls")
@user_errors
def ls(run: str = typer.Argument(..., help="Run name (runs/<name>), path or URL."),
       storage: Optional[list[str]] = StorageOverridesArg,
       storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Complete checkpoints of a run: step, world size, total and newly written bytes."""
    from cs3ray.ckpt import list_checkpoints
    from cs3ray.config import runtime_storage_options

    listing = list_checkpoints(run, runtime_storage_options(storage or [], storage_options))
    table = Table("step", "world", "tensor MB", "new MB", "chunks", "created", title=f"checkpoints of {listing['run']}")
    for r in listing["checkpoints"]:
        mb = lambda v: "-" if v is None else f"{v / 2**20:,.1f}"  # noqa: E731
        table.add_row(str(r["step"]), str(r["world_size"]), mb(r["bytes_total"]), mb(r["bytes_written"]),
                      str(r["chunks"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"] or 0)))
    (err_console if as_json else console).print(table)
    if as_json:
        print(json.dumps(listing))


@app.command("verify")
@user_errors
def verify(target: str = typer.Argument(..., help="RUN (every checkpoint), RUN/STEP or a checkpoint folder."),
           storage: Optional[list[str]] = StorageOverridesArg,
           storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Hash every file and every chunk against the manifest; exit 2 if any checkpoint is bad."""
    from cs3ray.ckpt import CheckpointError, verify_checkpoints
    from cs3ray.config import runtime_storage_options

    out = err_console if as_json else console

    def show(r: dict) -> None:
        if r["ok"]:
            out.print(f"[green]ok[/]  {escape(r['url'])}  ({r['files']} files, {r['chunks']} chunks)", highlight=False)
        else:
            out.print(f"[red]bad[/] {escape(r['url'])}: {escape(r['error'])}", highlight=False)

    results = verify_checkpoints(target, runtime_storage_options(storage or [], storage_options), show)
    bad = [r["error"] for r in results if not r["ok"]]
    if as_json:
        print(json.dumps({"checkpoints": results, "ok": not bad}))
    if bad:
        raise CheckpointError(f"{len(bad)} of {len(results)} checkpoint(s) failed verification: {bad[0]}")


@app.command("export")
@user_errors
def export(target: str = typer.Argument(..., help="RUN (its newest checkpoint), RUN/STEP or a checkpoint folder."),
           storage: Optional[list[str]] = StorageOverridesArg,
           fmt: str = typer.Option("safetensors", "--format", help="safetensors, torch (a plain dict of tensors) or "
                                                                   "hf (a Hugging Face Llama directory)."),
           out: Optional[str] = typer.Option(None, "--out", "-o", help="Output file, a directory for hf (default: "
                                                                      "model-step<N>.<ext>, model-step<N>-hf)."),
           dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast the tensors to fp32, bf16 or fp16 "
                                                                     "(default: as stored, fp32)."),
           replica: Optional[list[str]] = ReplicaOpt, use_stored_replicas: bool = StoredReplicasOpt,
           storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Write one consolidated model file that loads without cs3ray (safetensors or torch.load), or a Hugging Face
    Llama directory (--format hf) that transformers' LlamaForCausalLM.from_pretrained loads."""
    from cs3ray.ckpt import CheckpointError, resolve_target
    from cs3ray.ckpt.export import FORMATS
    from cs3ray.ckpt.export import export as export_ckpt
    from cs3ray.config import runtime_storage_options
    from cs3ray.core.precision import DTYPES

    if fmt not in FORMATS:
        raise CheckpointError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'.")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    options = runtime_storage_options(storage or [], storage_options)
    url = resolve_target(target, options)
    suffix = {"safetensors": ".safetensors", "torch": ".pt", "hf": "-hf"}[fmt]
    path = out or f"model-{os.path.basename(url.rstrip('/'))}{suffix}"
    r = export_ckpt(url, path, fmt, options, DTYPES[dtype] if dtype else None, replicas=replica or [],
                    stored_replicas=use_stored_replicas)
    (err_console if as_json else console).print(f"exported step {r['step']}: {r['tensors']} {r['dtype']} tensors, {r['bytes'] / 2**20:,.1f} MB -> {r['path']}",
                  highlight=False)
    if as_json:
        print(json.dumps(r))


@app.command("import-hf")
@user_errors
def import_hf(src: str = typer.Argument(..., help="Hugging Face Llama directory (local path or fsspec URL)."),
              name: str = typer.Option(..., "--name", help="Run to create (runs/<name>), path or URL."),
              tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="tokenizer.json (or a folder holding "
                                                      "one) to use instead of the directory's."),
              storage: Optional[list[str]] = StorageOverridesArg,
              storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Import a Hugging Face Llama directory (config.json, safetensors, tokenizer.json) as a run's step-0 checkpoint."""
    from cs3ray.ckpt.hf_import import import_hf as import_dir
    from cs3ray.config import runtime_storage_options

    out = err_console if as_json else console
    r = import_dir(src, name, runtime_storage_options(storage or [], storage_options), tokenizer,
                   note=note)
    out.print(f"imported {r['params']:,} parameters ({r['tokenizer']} tokenizer) -> {r['url']}", highlight=False)
    if as_json:
        print(json.dumps(r))

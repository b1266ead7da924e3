"""`cs3 ckpt ls|verify|export`: inspect, check and export a run's checkpoints."""

from __future__ import annotations

import json
import os
import time
from typing import Optional

import typer
from rich.table import Table

from cs3ray.ckpt import CheckpointError, list_checkpoints, resolve_target, verify_checkpoints
from cs3ray.config import runtime_storage_options

from .common import JsonOpt, StorageOptionsOpt, StorageOverridesArg, console, err_console, user_errors

app = typer.Typer(help="Checkpoints of a run: list them, verify checksums, export one file.", no_args_is_help=True)


@app.command("ls")
@user_errors
def ls(run: str = typer.Argument(..., help="Run name (runs/<name>), path or URL."),
       storage: Optional[list[str]] = StorageOverridesArg,
       storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Complete checkpoints of a run: step, world size, total and newly written bytes."""
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
    out = err_console if as_json else console

    def show(r: dict) -> None:
        if r["ok"]:
            out.print(f"[green]ok[/]  {r['url']}  ({r['files']} files, {r['chunks']} chunks)", highlight=False)
        else:
            out.print(f"[red]bad[/] {r['url']}: {r['error']}", highlight=False)

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
           fmt: str = typer.Option("safetensors", "--format", help="safetensors or torch (a plain dict of tensors)."),
           out: Optional[str] = typer.Option(None, "--out", "-o", help="Output file (default: model-step<N>.<ext>)."),
           dtype: Optional[str] = typer.Option(None, "--dtype", help="Cast the tensors to fp32, bf16 or fp16 "
                                                                     "(default: as stored, fp32)."),
           storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Write one consolidated model file that loads without cs3ray (safetensors or torch.load)."""
    from cs3ray.ckpt.export import FORMATS
    from cs3ray.ckpt.export import export as export_ckpt
    from cs3ray.core.precision import DTYPES

    if fmt not in FORMATS:
        raise CheckpointError(f"--format must be one of {', '.join(FORMATS)}, not '{fmt}'.")
    if dtype is not None and dtype not in DTYPES:
        raise CheckpointError(f"--dtype must be one of {', '.join(DTYPES)}, not '{dtype}'.")
    options = runtime_storage_options(storage or [], storage_options)
    url = resolve_target(target, options)
    ext = "safetensors" if fmt == "safetensors" else "pt"
    path = out or f"model-{os.path.basename(url.rstrip('/'))}.{ext}"
    r = export_ckpt(url, path, fmt, options, DTYPES[dtype] if dtype else None)
    (err_console if as_json else console).print(f"exported step {r['step']}: {r['tensors']} {r['dtype']} tensors, {r['bytes'] / 2**20:,.1f} MB -> {r['path']}",
                  highlight=False)
    if as_json:
        print(json.dumps(r))

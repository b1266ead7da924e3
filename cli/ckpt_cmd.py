"""`cs3 ckpt ls|verify|export`: inspect, check and export a run's checkpoints."""

from __future__ import annotations

import json
import os
import re
import time
from typing import Optional

import typer
from rich.table import Table

from cs3ray.ckpt import CheckpointError
from cs3ray.ckpt.locations import list_steps, open_folder, step_dir
from cs3ray.ckpt.manifest import read_manifest
from cs3ray.config import resolve_run, runtime_storage_options
from cs3ray.storage import StorageError, open_url

from .common import JsonOpt, StorageOptionsOpt, StorageOverridesArg, console, err_console, user_errors

app = typer.Typer(help="Checkpoints of a run: list them, verify checksums, export one file.", no_args_is_help=True)


def _target(arg: str, options: dict) -> str:
    """RUN, RUN/STEP (a number) or a checkpoint folder -> a RUN or folder URL."""
    m = re.fullmatch(r"(.+)/(\d+)", arg)
    if m and not os.path.exists(arg):
        return open_url(resolve_run(m.group(1)), options).child(step_dir(int(m.group(2)))).url
    return arg


@app.command("ls")
@user_errors
def ls(run: str = typer.Argument(..., help="Run name (runs/<name>), path or URL."),
       storage: Optional[list[str]] = StorageOverridesArg,
       storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Complete checkpoints of a run: step, world size, total and newly written bytes."""
    options = runtime_storage_options(storage or [], storage_options)
    storage = open_url(resolve_run(run), options)
    try:
        if not storage.exists():
            raise CheckpointError(f"run '{run}' does not exist (looked at '{storage.url}').")
        steps = list_steps(storage)
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None
    rows = []
    for s in steps:
        m = read_manifest(storage.child(step_dir(s)))
        rows.append({"step": s, "world_size": m["world_size"], "bytes_total": m.get("bytes_total"),
                     "bytes_written": m.get("bytes_written"), "chunks": len(m.get("chunks", {})),
                     "created": m.get("created"), "url": storage.child(step_dir(s)).url})
    table = Table("step", "world", "tensor MB", "new MB", "chunks", "created", title=f"checkpoints of {storage.url}")
    for r in rows:
        mb = lambda v: "-" if v is None else f"{v / 2**20:,.1f}"  # noqa: E731
        table.add_row(str(r["step"]), str(r["world_size"]), mb(r["bytes_total"]), mb(r["bytes_written"]),
                      str(r["chunks"]), time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["created"] or 0)))
    (err_console if as_json else console).print(table)
    if as_json:
        print(json.dumps({"run": storage.url, "checkpoints": rows}))


@app.command("verify")
@user_errors
def verify(target: str = typer.Argument(..., help="RUN (every checkpoint), RUN/STEP or a checkpoint folder."),
           storage: Optional[list[str]] = StorageOverridesArg,
           storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Hash every file and every chunk against the manifest; exit 2 if any checkpoint is bad."""
    options = runtime_storage_options(storage or [], storage_options)
    url = _target(target, options)
    storage = open_url(resolve_run(url), options)
    try:
        folders = [storage] if storage.exists("manifest.json") else \
            [storage.child(step_dir(s)) for s in list_steps(storage)]
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None
    if not folders:
        raise CheckpointError(f"'{storage.url}' has no complete checkpoint to verify.")
    results, bad = [], []
    for folder in folders:
        try:
            _, step, m = open_folder(folder, deep=True)
            results.append({"url": folder.url, "ok": True, "step": step, "files": len(m["files"]),
                            "chunks": len(m.get("chunks", {}))})
            (err_console if as_json else console).print(f"[green]ok[/]  {folder.url}  ({len(m['files'])} files, {len(m.get('chunks', {}))} chunks)",
                          highlight=False)
        except (CheckpointError, StorageError) as exc:
            results.append({"url": folder.url, "ok": False, "error": str(exc)})
            bad.append(str(exc))
            (err_console if as_json else console).print(f"[red]bad[/] {folder.url}: {exc}", highlight=False)
    if as_json:
        print(json.dumps({"checkpoints": results, "ok": not bad}))
    if bad:
        raise CheckpointError(f"{len(bad)} of {len(folders)} checkpoint(s) failed verification: {bad[0]}")


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
    url = _target(target, options)
    ext = "safetensors" if fmt == "safetensors" else "pt"
    path = out or f"model-{os.path.basename(url.rstrip('/'))}.{ext}"
    r = export_ckpt(url, path, fmt, options, DTYPES[dtype] if dtype else None)
    (err_console if as_json else console).print(f"exported step {r['step']}: {r['tensors']} {r['dtype']} tensors, {r['bytes'] / 2**20:,.1f} MB -> {r['path']}",
                  highlight=False)
    if as_json:
        print(json.dumps(r))

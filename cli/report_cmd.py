"""`cs3 report RUN` (plots and a markdown summary of a run) and `cs3 runs ls` (every run, its status)."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer
from rich.markup import escape
from rich.table import Table

from .common import JsonOpt, StorageOptionsOpt, StorageOverridesArg, console, err_console, user_errors

# cs3ray.config.runs.RUNS_DIR, for --dir's default (importing cs3ray.config would load pydantic and fsspec for every
# command, --help included); a test checks they agree.
RUNS_DIR = "runs"

runs_app = typer.Typer(help="Runs: list them with their status, steps, best validation loss and newest checkpoint.",
                       no_args_is_help=True)


@user_errors
def report(run: str = typer.Argument(..., help="Run name (runs/<name>), path or URL."),
           storage: Optional[list[str]] = StorageOverridesArg,
           out: Optional[str] = typer.Option(None, "--out", "-o", help="Folder (or URL) for the PNGs and report.md "
                                                                       "(default: <run dir>/report)."),
           storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Plot a run's loss, validation loss, tokens/s, MFU and cache hit rate (PNG each) and summarise it in report.md."""
    from cs3ray.config import runtime_storage_options
    from cs3ray.ops.report import REPORT_DIR, write_report
    from cs3ray.ops.runs_overview import load_run
    from cs3ray.storage import open_url

    options = runtime_storage_options(storage or [], storage_options)
    record = load_run(run, options)
    target = open_url(out, options) if out else record.storage.child(REPORT_DIR)
    r = write_report(record, target)
    shown = err_console if as_json else console
    for name, title in r.plots.items():
        shown.print(f"wrote {target.child(name).url}  ({title})", markup=False, highlight=False)
    for name, why in r.skipped.items():
        shown.print(f"[yellow]skipped[/] {escape(name)}: {escape(why)}", highlight=False)
    shown.print(f"summary: {target.child('report.md').url}", markup=False, highlight=False)
    if as_json:
        print(json.dumps(r.to_dict()))


@runs_app.command("ls")
@user_errors
def ls(runs_dir: str = typer.Option(RUNS_DIR, "--dir", help="Folder (or URL) holding the runs."),
       storage: Optional[list[str]] = StorageOverridesArg,
       storage_options: Optional[str] = StorageOptionsOpt, as_json: bool = JsonOpt) -> None:
    """Every run below --dir: status, steps, best validation loss, newest checkpoint."""
    from cs3ray.config import runtime_storage_options
    from cs3ray.ops.runs_overview import list_runs

    rows = [r.overview() for r in list_runs(runs_dir, runtime_storage_options(storage or [], storage_options))]
    table = Table("run", "status", "step", "best val loss", "checkpoint", "last event", title=f"runs in {runs_dir}")
    for r in rows:
        steps = f"{r['step']}/{r['total_steps']}" if r["total_steps"] else str(r["step"])
        best = "-" if r["best_val_loss"] is None else f"{r['best_val_loss']:.4f}"
        last = time.strftime("%m-%d %H:%M", time.localtime(r["last_event"])) if r["last_event"] else "-"
        table.add_row(r["run"], r["status"], steps, best,
                      "-" if r["checkpoint_step"] is None else f"step {r['checkpoint_step']}", last)
    (err_console if as_json else console).print(table)
    if as_json:
        print(json.dumps({"dir": runs_dir, "runs": rows}))

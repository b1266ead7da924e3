"""`cs3 cache warm|stats|clear`: fill, inspect and empty the node-local shard cache (L2)."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from .common import JsonOpt, OverridesArg, console, overrides_list, user_errors

app = typer.Typer(help="The node-local shard cache: warm it before training, inspect it, clear it.",
                  no_args_is_help=True)
ConfigOpt = typer.Option(None, "--config", "-c", help="Job YAML whose cache and storage sections apply.")


def _config(config: Optional[str], overrides: Optional[list[str]]):
    from cs3ray.config import load_config

    return load_config(config, overrides_list(overrides))


@app.command("warm")
@user_errors
def warm(url: str = typer.Argument(..., help="Prepared shard set (folder with manifest.json): path or fsspec URL."),
         overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt,
         split: str = typer.Option("train", help="Which split to cache."), as_json: bool = JsonOpt) -> None:
    """Copy a shard set into this node's L2 cache (up to cache.disk_bytes), so step 1 reads local disk."""
    from cs3ray.data.cache import warm_node

    cfg = _config(config, overrides)
    with Progress(TextColumn("warming L2"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  TimeRemainingColumn(), console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("warm", total=None)
        summary = warm_node(url, cfg.cache, cfg.storage.options, split,
                            progress=lambda n, want: bar.update(task, total=want, advance=n))
    if as_json:
        print(json.dumps(summary))
        return
    cached, shards = summary["cached_shards"], summary["shards"]
    note = "" if cached == shards else f" ({shards - cached} did not fit in cache.disk_bytes)"
    console.print(f"cached {cached}/{shards} shards of {summary['url']} in {summary['seconds']}s{note}; "
                  f"L2 at {summary['disk_dir']} holds {summary['disk_used_bytes'] / 2**20:,.1f} MiB of "
                  f"{summary['disk_bytes'] / 2**20:,.0f} MiB")


@app.command("stats")
@user_errors
def stats(overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt,
          as_json: bool = JsonOpt) -> None:
    """Hits, misses and bytes per tier, bytes read from L3 and time waited, summed over this node's processes."""
    from cs3ray.data.cache import node_stats

    s, mib = node_stats(_config(config, overrides).cache), 2**20
    if as_json:
        print(json.dumps(s))
        return
    table = Table("tier", "hits", "misses", "bytes served", title=f"shard cache at {s['disk_dir']}")
    table.add_row("L1 memory", str(s["l1_hits"]), str(s["l1_misses"]), f"{s['l1_bytes'] / mib:,.1f} MiB")
    table.add_row("L2 disk", str(s["l2_hits"]), str(s["l2_misses"]), f"{s['l2_bytes'] / mib:,.1f} MiB")
    table.add_row("L3 storage", str(s["l3_reads"]), "-", f"{s['l3_bytes'] / mib:,.1f} MiB")
    console.print(table)
    console.print(f"L2 holds {s['disk_files']} shards, {s['disk_used_bytes'] / mib:,.1f} of {s['disk_bytes'] / mib:,.0f} "
                  f"MiB; {s['processes']} processes reported; corrupt L2 files replaced: {s['l2_corrupt']}; "
                  f"L3 retries: {s['l3_retries']}; time waited for data: {s['wait_s']:.2f}s")


@app.command("clear")
@user_errors
def clear(overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt) -> None:
    """Delete every shard in the L2 cache directory (counters are kept)."""
    from cs3ray.data.cache import clear_node

    done = clear_node(_config(config, overrides).cache)
    console.print(f"freed {done['freed_bytes'] / 2**20:,.1f} MiB at {done['disk_dir']}")

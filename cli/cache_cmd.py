"""`cs3 cache warm|stats|clear`: fill, inspect and empty the node-local shard cache (L2)."""

from __future__ import annotations

import json
import time
from typing import Optional

import typer
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn, TransferSpeedColumn
from rich.table import Table

from cs3ray.config import load_config
from cs3ray.data.cache import TieredCache, namespace, read_all, total
from cs3ray.data.cache.disk import DiskTier
from cs3ray.data.cache.policy import NoEvict
from cs3ray.data.shards import read_manifest
from cs3ray.storage import open_url

from .common import JsonOpt, OverridesArg, console, overrides_list, user_errors

app = typer.Typer(help="The node-local shard cache: warm it before training, inspect it, clear it.",
                  no_args_is_help=True)
ConfigOpt = typer.Option(None, "--config", "-c", help="Job YAML whose cache and storage sections apply.")


def _config(config: Optional[str], overrides: Optional[list[str]]):
    return load_config(config, overrides_list(overrides))


@app.command("warm")
@user_errors
def warm(url: str = typer.Argument(..., help="Prepared shard set (folder with manifest.json): path or fsspec URL."),
         overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt,
         split: str = typer.Option("train", help="Which split to cache."), as_json: bool = JsonOpt) -> None:
    """Copy a shard set into this node's L2 cache (up to cache.disk_bytes), so step 1 reads local disk."""
    cfg = _config(config, overrides)
    source = open_url(url, cfg.storage.options)
    manifest = read_manifest(source)
    entries = manifest["splits"].get(split)
    if not entries:
        raise typer.BadParameter(f"split '{split}' is not in the manifest (splits: {', '.join(manifest['splits'])})")
    c = cfg.cache
    cache = TieredCache(source, entries, memory_bytes=0, disk_bytes=c.disk_bytes, disk_dir=c.disk_dir,
                        policy=c.policy, prefetch_threads=max(1, min(8, c.prefetch)),
                        retry_deadline_s=c.retry_deadline_s)
    want = sum(e["bytes"] for e in entries)
    t0 = time.perf_counter()
    with cache, Progress(TextColumn("warming L2"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                         TimeRemainingColumn(), console=console, transient=True, disable=as_json) as bar:
        task = bar.add_task("warm", total=want)
        cache.warm([e["file"] for e in entries], progress=lambda n: bar.advance(task, n))
    files, used = cache.disk.usage()
    ns_dir = cache.disk.path(cache.ns, "")
    cached = sum(1 for e in entries if _exists(ns_dir + e["file"]))
    summary = {"url": source.url, "split": split, "shards": len(entries), "cached_shards": cached,
               "bytes": want, "l3_bytes": cache.stats.l3_bytes, "seconds": round(time.perf_counter() - t0, 2),
               "disk_dir": cache.disk.root, "disk_used_bytes": used, "disk_bytes": c.disk_bytes}
    if as_json:
        print(json.dumps(summary))
        return
    note = "" if cached == len(entries) else f" ({len(entries) - cached} did not fit in cache.disk_bytes)"
    console.print(f"cached {cached}/{len(entries)} shards of {source.url} in {summary['seconds']}s{note}; "
                  f"L2 at {cache.disk.root} holds {used / 2**20:,.1f} MiB of {c.disk_bytes / 2**20:,.0f} MiB")


def _exists(path: str) -> bool:
    import os

    return os.path.exists(path)


@app.command("stats")
@user_errors
def stats(overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt,
          as_json: bool = JsonOpt) -> None:
    """Hits, misses and bytes per tier, bytes read from L3 and time waited, summed over this node's processes."""
    cfg = _config(config, overrides)
    tier = DiskTier(cfg.cache.disk_dir, cfg.cache.disk_bytes, NoEvict())
    files, used = tier.usage()
    procs = read_all(tier.root)
    s = total(procs)
    result = {"disk_dir": tier.root, "disk_files": files, "disk_used_bytes": used, "disk_bytes": cfg.cache.disk_bytes,
              "processes": len(procs), "hit_rate": round(s.hit_rate(), 4), **s.to_dict()}
    if as_json:
        print(json.dumps(result))
        return
    table = Table("tier", "hits", "misses", "bytes served", title=f"shard cache at {tier.root}")
    table.add_row("L1 memory", str(s.l1_hits), str(s.l1_misses), f"{s.l1_bytes / 2**20:,.1f} MiB")
    table.add_row("L2 disk", str(s.l2_hits), str(s.l2_misses), f"{s.l2_bytes / 2**20:,.1f} MiB")
    table.add_row("L3 storage", str(s.l3_reads), "-", f"{s.l3_bytes / 2**20:,.1f} MiB")
    console.print(table)
    console.print(f"L2 holds {files} shards, {used / 2**20:,.1f} of {cfg.cache.disk_bytes / 2**20:,.0f} MiB; "
                  f"{len(procs)} processes reported; corrupt L2 files replaced: {s.l2_corrupt}; "
                  f"L3 retries: {s.l3_retries}; time waited for data: {s.wait_s:.2f}s")


@app.command("clear")
@user_errors
def clear(overrides: Optional[list[str]] = OverridesArg, config: Optional[str] = ConfigOpt) -> None:
    """Delete every shard in the L2 cache directory (counters are kept)."""
    cfg = _config(config, overrides)
    tier = DiskTier(cfg.cache.disk_dir, cfg.cache.disk_bytes, NoEvict())
    freed = tier.clear()
    console.print(f"freed {freed / 2**20:,.1f} MiB at {tier.root}")


__all__ = ["app", "namespace"]

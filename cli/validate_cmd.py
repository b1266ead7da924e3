"""`cs3 validate`: the acceptance checklist measured on a cluster, PASS/FAIL per item."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cs3ray.bench.report import emit, measured
from cs3ray.errors import UserError

from .common import AddressOpt, JsonOpt, err_console, note, user_errors

OutOpt = typer.Option(None, "--out", help="Also write the report as markdown to FILE.")


class ChecklistFailed(UserError):
    """Some item of the checklist failed; exit code 1, as a failed measurement's."""

    exit_code = 1


@user_errors
def validate_cmd(address: Optional[str] = AddressOpt,
                 quick: bool = typer.Option(False, "--quick", help="A short pass of every item (about 90 s on 2 cores)."),
                 storage: Optional[str] = typer.Option(None, "--storage", help="Where to measure read throughput: a "
                                                       "folder or fsspec URL, e.g. your runs' bucket (default: a temp folder)."),
                 min_mfu: float = typer.Option(0.2, "--min-mfu", min=0.0, max=1.0, help="MFU the validation run must "
                                               "reach: the tiny model under-fills accelerators, so lower it on GPU nodes "
                                               "(and judge your own model with `cs3 bench train`)."),
                 link_gbps: Optional[float] = typer.Option(None, "--link-gbps", min=0.001, help="The link between nodes "
                                                           "in Gb/s per rank (e.g. 400 for one NDR port per GPU): "
                                                           "collective_busbw fails below 80% of it. Default: the "
                                                           "InfiniBand detected, or point-to-point on CPU clusters."),
                 cache: Optional[str] = typer.Option(None, "--cache", help="The data cache folder (data.cache_dir) whose "
                                                     "random-read IOPS are measured besides --storage's."),
                 out: Optional[Path] = OutOpt,
                 soak: Optional[str] = typer.Option(None, "--soak", help="Instead of the checklist: train, checkpoint, "
                                                    "kill a worker and serve for DURATION (e.g. 20m), sampling every "
                                                    "Ray process; fail any series that would outgrow its limit in 72 h."),
                 soak_interval: str = typer.Option("60s", "--soak-interval", help="--soak: time between samples."),
                 as_json: bool = JsonOpt) -> None:
    """Measure the go-live checklist on the cluster: versions and clocks, collective bandwidth vs the link,
    training MFU, recovery from a killed worker, serving P99 inter-token latency, storage reads and IOPS,
    metrics; with GPUs, nccl bandwidth, MFU, serving and health on them. An item the cluster cannot measure is
    NOT MEASURED, never PASS. Exit codes: 0 no item failed (those not measured are named); 1 an item failed
    (named); 2 bad input."""
    from cs3ray.bench import validate

    if soak is not None:
        _soak(address, soak, soak_interval, as_json)
        return
    r = measured("validate", validate.run, address, quick, storage, min_mfu,
                 log=note, link_gbps=link_gbps, cache=cache)
    emit(f"cs3 validate ({r['level']}; figures measured repeatedly: median of the rounds [95% interval], "
         "PASS needs the verdict met)", validate.COLUMNS, validate.rows(r), r, as_json)
    if out is not None:
        out.write_text(validate.markdown(r))
        err_console.print(f"report: {out}", highlight=False)
    if r["not_measured"]:
        err_console.print(f"validate: {len(r['not_measured'])} of {len(r['checks'])} items not measured on this "
                          f"cluster: {', '.join(r['not_measured'])}", highlight=False, soft_wrap=True)
    failed = r["failed"]
    if failed:
        raise ChecklistFailed(f"validate: {len(failed)} of {len(r['checks'])} items failed: {', '.join(failed)}")


def _soak(address: Optional[str], duration: str, interval: str, as_json: bool) -> None:
    from cs3ray.bench import soak
    from cs3ray.ops.soak import parse_duration

    try:
        duration_s, interval_s = parse_duration(duration), parse_duration(interval)
    except ValueError as exc:
        raise UserError(f"--soak / --soak-interval: {exc}") from None
    if interval_s * 3 > duration_s:
        raise UserError(f"--soak {duration} holds fewer than 3 samples of --soak-interval {interval}: a slope needs more.")
    r = measured("soak", soak.run, duration_s, interval_s, address,
                 log=note)
    emit(f"soak of {duration_s:.0f} s, a sample every {interval_s:.0f} s ({r['samples']} samples; {r['training_steps']} "
         f"training steps, {r['checkpoints']} checkpoints, {r['restarts']} restart(s), {r['requests']} requests, "
         f"{r['errors']} errors): failed series and every aggregate, growth extrapolated to 72 h",
         soak.COLUMNS, soak.rows(r), r, as_json)
    if r["soak"]["failed"]:
        names = ", ".join(f"{s['process']} {s['metric']}" for s in r["soak"]["failed"])
        raise ChecklistFailed(f"soak: {len(r['soak']['failed'])} series would outgrow their limit in 72 h: {names}")

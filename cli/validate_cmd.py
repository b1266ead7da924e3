"""`cs3 validate`: the acceptance checklist measured on a cluster, PASS/FAIL per item."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cs3ray.bench.report import emit, measured
from cs3ray.errors import UserError

from .common import AddressOpt, JsonOpt, err_console, user_errors

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
                 out: Optional[Path] = OutOpt,
                 as_json: bool = JsonOpt) -> None:
    """Measure the go-live checklist on the cluster: versions and clocks, collective bandwidth vs the link,
    training MFU, recovery from a killed worker, serving P99 inter-token latency, storage reads, metrics.
    Exit codes: 0 every item passed; 1 an item failed (named); 2 bad input."""
    from cs3ray.bench import validate

    r = measured("validate", validate.run, address, quick, storage, min_mfu,
                 log=lambda line: err_console.print(line, highlight=False))
    emit(f"cs3 validate ({r['level']}; figures measured repeatedly: median of the rounds [95% interval], "
         "PASS needs the verdict met)", validate.COLUMNS, validate.rows(r), r, as_json)
    if out is not None:
        out.write_text(validate.markdown(r))
        err_console.print(f"report: {out}", highlight=False)
    failed = [name for name, c in r["checks"].items() if not c["passed"]]
    if failed:
        raise ChecklistFailed(f"validate: {len(failed)} of {len(r['checks'])} items failed: {', '.join(failed)}")

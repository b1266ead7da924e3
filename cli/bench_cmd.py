"""`cs3 bench ...`: benchmarks that compare against their peer in the same run."""

from __future__ import annotations

import os

import typer

from cs3ray.bench import peak
from cs3ray.bench.report import emit

from .common import JsonOpt

app = typer.Typer(help="Benchmarks: each compares cs3ray with its peer in one run and prints ratios.",
                  no_args_is_help=True)
QuickOpt = typer.Option(False, "--quick", help="A short run (seconds) for smoke tests.")


@app.command("peak")
def peak_cmd(threads: int = typer.Option(os.cpu_count() or 1, min=1, help="Torch threads."),
             quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Measure the matmul peak (fp32 and bf16) that MFU is computed against."""
    r = peak.run(threads, quick)
    emit("matmul peak", ["dtype", "TFLOP/s"],
         [("fp32", r["fp32_flops"] / 1e12), ("bf16", r["bf16_flops"] / 1e12)], r, as_json)

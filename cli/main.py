"""The `cs3` application: one typer group per file, joined here."""

from __future__ import annotations

import os

import typer

# Every `cs3` run imports these modules: their commands import torch, Ray and cs3ray's heavy modules when they run.
from . import bench_cmd, cache_cmd, ckpt_cmd, cluster_cmd, config_cmd, data_cmd, jobs_cmd
from .generate_cmd import generate
from .plan_cmd import plan_cmd
from .report_cmd import report, runs_app
from .serve_cmd import serve
from .train_cmd import train_cmd
from .validate_cmd import validate_cmd

app = typer.Typer(help="cs3ray: elastic training and serving of PyTorch models on Ray.",
                  no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False)
app.command("train")(train_cmd)
app.command("generate")(generate)
app.command("serve")(serve)
app.command("submit")(jobs_cmd.submit)
app.add_typer(jobs_cmd.app, name="jobs")
app.command("up")(cluster_cmd.up_cmd)
app.command("down")(cluster_cmd.down_cmd)
app.command("status")(cluster_cmd.status_cmd)
app.add_typer(config_cmd.app, name="config")
app.add_typer(data_cmd.app, name="data")
app.add_typer(bench_cmd.app, name="bench")
app.add_typer(cache_cmd.app, name="cache")
app.add_typer(ckpt_cmd.app, name="ckpt")
app.command("report")(report)
app.command("plan")(plan_cmd)
app.command("validate")(validate_cmd)
app.add_typer(runs_app, name="runs")


def main() -> None:
    """Console-script entry point; the process ends as soon as the command has (cs3ray.ops.process_exit)."""
    from cs3ray.ops.process_exit import exit_now

    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    try:
        app()
    except SystemExit as exc:  # typer ends every command with one, its status included
        exit_now(exc.code)
    exit_now(0)


if __name__ == "__main__":
    main()

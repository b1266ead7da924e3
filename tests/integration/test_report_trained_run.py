"""`cs3 report` and `cs3 runs ls` on the session's trained run (a real 10-step training on Ray)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cs3ray_cli.main import app

from conftest import TRAINED_STEPS, run_cs3
from helpers.images import read_png

PLOTS = ["loss.png", "tokens_per_s.png", "mfu.png", "cache_hit_rate.png"]


def test_report_plots_the_trained_run(trained_run, tmp_path):
    run_dir, summary = trained_run
    out = tmp_path / "report"  # not inside the shared run, which other tests read
    proc = run_cs3(["report", str(run_dir), "--out", str(out), "--json"], check=True)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Every figure has data: the workers' progress events carry their shard cache counters.
    assert list(report["plots"]) == PLOTS and report["skipped"] == {}
    md = (out / "report.md").read_text()
    for name in PLOTS:
        read_png(out / name)
        assert f"]({name})" in md
    assert report["figures"]["status"] == "finished" and report["figures"]["steps"] == TRAINED_STEPS
    assert report["figures"]["final_val_loss"] == summary["final_val_loss"]
    assert f"| newest_checkpoint | {summary['checkpoint']} |" in md


def test_runs_ls_lists_the_trained_run(trained_run):
    run_dir, summary = trained_run
    result = CliRunner().invoke(app, ["runs", "ls", "--dir", str(run_dir.parent), "--json"])
    assert result.exit_code == 0, result.output
    [row] = json.loads(result.stdout.strip().splitlines()[-1])["runs"]
    assert (row["run"], row["status"], row["step"], row["total_steps"]) == ("tiny", "finished", TRAINED_STEPS,
                                                                           TRAINED_STEPS)
    assert row["checkpoint_step"] == TRAINED_STEPS and row["checkpoint"] == summary["checkpoint"]
    assert row["best_val_loss"] <= summary["final_val_loss"] < summary["initial_val_loss"]


"""`cs3 report` and `cs3 runs ls` on run directories written here: statuses, plots, markers, bad input."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cs3ray.ckpt import step_dir
from cs3ray.ckpt.manifest import MANIFEST
from cs3ray.ops.report import cache_hit_rates
from cs3ray.ops.runs_overview import FINISHED, NO_EVENTS, STOPPED, UNFINISHED, load_run
from cs3ray_cli.main import app

from helpers.images import has_colour, read_png

TAB_RED, TAB_BLUE = (0.839, 0.153, 0.157), (0.122, 0.467, 0.706)


def _progress(step: int, loss: float, reads: int, l1_hits: int) -> dict:
    cache = {"l1_hits": l1_hits, "l1_misses": reads - l1_hits, "l2_hits": reads - l1_hits, "l2_misses": 0}
    return {"event": "progress", "step": step, "loss": loss, "tokens_per_s": 1000.0 + step, "mfu": 0.01 * step,
            "cache": cache}


def _resumed_run() -> list[dict]:
    """20 steps: interrupted after the checkpoint at 10, resumed from it (new worker, counters from zero)."""
    ev = [{"event": "start", "step": 0, "total_steps": 20, "workers": 2}, {"event": "eval", "step": 0, "val_loss": 5.0}]
    ev += [_progress(s, 5.0 - 0.1 * s, reads=4 * s, l1_hits=s) for s in (2, 4, 6, 8, 10)]
    ev += [{"event": "eval", "step": 10, "val_loss": 4.0}, {"event": "checkpoint", "step": 10, "url": "x"},
           _progress(12, 3.9, reads=48, l1_hits=12),  # trained past the checkpoint, then interrupted
           {"event": "start", "step": 10, "total_steps": 20, "workers": 2}, {"event": "restored", "step": 10}]
    ev += [_progress(s, 5.0 - 0.1 * s, reads=4 * (s - 10), l1_hits=3 * (s - 10)) for s in (12, 14, 16, 18, 20)]
    ev += [{"event": "eval", "step": 20, "val_loss": 3.2}, {"event": "checkpoint", "step": 20, "url": "y"},
           {"event": "end", "step": 20, "val_loss": 3.2, "initial_val_loss": 5.0, "stopped": False}]
    return ev


def _write(run_dir, events: list[dict], checkpoints: tuple[int, ...] = (), torn: bool = False):
    run_dir.mkdir(parents=True)
    text = "".join(json.dumps({"time": 1.8e9 + i, **e}) + "\n" for i, e in enumerate(events))
    (run_dir / "events.jsonl").write_text(text + ('{"event": "progr' if torn else ""))
    for s in checkpoints:
        (run_dir / step_dir(s)).mkdir()
        (run_dir / step_dir(s) / MANIFEST).write_text("{}")
    return run_dir


def test_status_steps_and_best_loss_from_the_events(tmp_path):
    run = load_run(str(_write(tmp_path / "resumed", _resumed_run(), checkpoints=(10, 20))))
    assert (run.status, run.step, run.total_steps, run.best_val_loss) == (FINISHED, 20, 20, 3.2)
    assert run.overview()["checkpoint_step"] == 20 and run.overview()["restores"] == 1
    stopped = _resumed_run()
    stopped[-1]["stopped"] = True
    assert load_run(str(_write(tmp_path / "stopped", stopped))).status == STOPPED
    # An `end` before the last `start` belongs to an earlier invocation; a torn last line is skipped.
    again = _resumed_run() + [{"event": "start", "step": 20, "total_steps": 30}]
    assert load_run(str(_write(tmp_path / "again", again, torn=True))).status == UNFINISHED


def test_cache_hit_rates_per_tier_start_again_with_a_new_worker(tmp_path):
    rates = cache_hit_rates(load_run(str(_write(tmp_path / "r", _resumed_run()))))
    assert [r for _, r in rates["L1 (memory)"]] == [0.25] * 6 + [0.75] * 5  # counters from zero after the restore
    assert [r for _, r in rates["L2 (disk)"]] == [1.0] * 11


def test_report_writes_plots_with_restart_markers_and_a_summary(tmp_path):
    run_dir = _write(tmp_path / "resumed", _resumed_run(), checkpoints=(10, 20))
    result = CliRunner().invoke(app, ["report", str(run_dir), "--json"])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["out"] == str(run_dir / "report") and out["skipped"] == {}
    names = ["loss.png", "tokens_per_s.png", "mfu.png", "cache_hit_rate.png"]
    assert list(out["plots"]) == names
    md = (run_dir / "report" / "report.md").read_text()
    for name in names:
        rgb = read_png(run_dir / "report" / name)
        assert has_colour(rgb, TAB_BLUE), f"{name} has no data line"
        assert has_colour(rgb, TAB_RED), f"{name} has no restart marker"
        assert f"]({name})" in md
    assert "| status | finished |" in md and "| best_val_loss | 3.2000 |" in md and "| restores | 1 |" in md


def test_a_run_without_restores_has_no_restart_marker(tmp_path):
    events = [e for e in _resumed_run()[:8]] + [{"event": "end", "step": 10, "stopped": False}]
    run_dir = _write(tmp_path / "plain", events)
    result = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    assert not has_colour(read_png(tmp_path / "out" / "loss.png"), TAB_RED)


def test_a_plot_without_data_is_skipped_and_said(tmp_path):
    events = [{"event": "start", "step": 0, "total_steps": 4}, {"event": "eval", "step": 0, "val_loss": 5.0},
              {"event": "progress", "step": 2, "loss": 4.5, "tokens_per_s": 900.0, "mfu": 0.0}]
    run_dir = _write(tmp_path / "nocache", events)
    result = CliRunner().invoke(app, ["report", str(run_dir), "--json"])
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert list(out["plots"]) == ["loss.png", "tokens_per_s.png"]
    assert set(out["skipped"]) == {"mfu.png", "cache_hit_rate.png"}
    assert "## Not plotted" in (run_dir / "report" / "report.md").read_text()
    assert out["figures"]["status"] == UNFINISHED


def test_runs_ls_lists_every_run_with_its_status(tmp_path):
    _write(tmp_path / "runs" / "done", _resumed_run(), checkpoints=(10, 20))
    _write(tmp_path / "runs" / "cut", _resumed_run()[:10], checkpoints=(10,))
    (tmp_path / "runs" / "new").mkdir()
    (tmp_path / "runs" / "new" / "config.yaml").write_text("{}")
    (tmp_path / "runs" / "not-a-run").mkdir()
    result = CliRunner().invoke(app, ["runs", "ls", "--dir", str(tmp_path / "runs"), "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["run"]: r for r in json.loads(result.stdout.strip().splitlines()[-1])["runs"]}
    assert set(rows) == {"done", "cut", "new"}
    assert (rows["done"]["status"], rows["done"]["step"], rows["done"]["checkpoint_step"]) == (FINISHED, 20, 20)
    assert (rows["cut"]["status"], rows["cut"]["step"], rows["cut"]["checkpoint_step"]) == (UNFINISHED, 12, 10)
    assert rows["cut"]["best_val_loss"] == 4.0
    assert rows["new"]["status"] == NO_EVENTS


def test_bad_runs_are_one_sentence_exit_2(tmp_path):
    cli = CliRunner()
    (tmp_path / "empty").mkdir()
    for args, words in ((["report", str(tmp_path / "nope")], "does not exist"),
                        (["report", str(tmp_path / "empty")], "has no events"),
                        (["runs", "ls", "--dir", str(tmp_path / "nope")], "no runs directory")):
        result = cli.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert words in result.output and result.output.strip().count("\n") == 0


def test_a_run_on_an_fsspec_url_is_reported_into_its_own_folder():
    import fsspec

    fs = fsspec.filesystem("memory")
    text = "".join(json.dumps({"time": 1.8e9 + i, **e}) + "\n" for i, e in enumerate(_resumed_run()))
    fs.pipe_file("/reports-test/runs/remote/events.jsonl", text.encode())
    cli = CliRunner()
    result = cli.invoke(app, ["report", "memory://reports-test/runs/remote", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout.strip().splitlines()[-1])["out"] == "memory://reports-test/runs/remote/report"
    assert fs.cat_file("/reports-test/runs/remote/report/loss.png")[:4] == b"\x89PNG"
    assert "](loss.png)" in fs.cat_file("/reports-test/runs/remote/report/report.md").decode()
    listing = cli.invoke(app, ["runs", "ls", "--dir", "memory://reports-test/runs", "--json"])
    assert [r["status"] for r in json.loads(listing.stdout.strip().splitlines()[-1])["runs"]] == [FINISHED]

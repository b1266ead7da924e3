"""A run trained by `cs3 train` on the session's head leaves only owner-only files (0600) and folders (0700)
in its run directory (config, events, summary, checkpoints, data trace), while Ray's logs keep Ray's modes."""

from __future__ import annotations

import stat
from pathlib import Path

from helpers.modes import not_private


def test_a_trained_runs_directory_is_its_owners_alone(trained_run, ray_client):
    run_dir, _ = trained_run
    names = {p.name for p in run_dir.rglob("*")}
    assert {"config.yaml", "events.jsonl", "summary.json", "manifest.json", ".metadata"} <= names, sorted(names)
    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700
    assert not_private(run_dir) == []
    # Ray's logs are not ours to close: a log shipper reads them (Ray creates them 0644 under a usual umask).
    logs = Path(ray_client._private.worker._global_node.get_logs_dir_path())  # the head's session (no public API)
    assert any(stat.S_IMODE(p.stat().st_mode) & 0o044 for p in logs.glob("*.log"))

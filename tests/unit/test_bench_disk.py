"""`cs3 bench disk`: a checkpoint-sized write beside a GEMM loop, against the same loop alone."""

from cs3ray.bench import disk


def test_quick_run_writes_through_the_checkpoint_path_and_reports_the_cost(tmp_path, monkeypatch):
    import cs3ray.storage as storage

    synced: list[str] = []
    real = storage.sync_filesystem
    monkeypatch.setattr(storage, "sync_filesystem", lambda p: (synced.append(p), real(p))[1])
    r = disk.run(str(tmp_path), quick=True, threads=1)
    assert r["write_mb"] == 64 and r["files"] == 32 and r["threads"] == 1
    assert r["write_s"] > 0 and r["writer_cpu_s"] > 0 and r["gemm_per_s"] > 0
    assert r["compute_lost_s_per_gb"] == r["compute_lost_s"] * 16
    assert r["repeats"] == 2 and len(r["compute_lost_s_rounds"]) == len(r["lost_over_writer_cpu_rounds"]) == 2
    low, high = r["compute_lost_s_interval"]
    assert low <= r["compute_lost_s"] <= high  # the median of 2 rounds is their mean, inside its t interval
    # One sync a round for all of its chunk files.
    assert len(synced) == r["repeats"] and all(p.startswith(str(tmp_path)) for p in synced)
    assert list(tmp_path.iterdir()) == []  # nothing left behind

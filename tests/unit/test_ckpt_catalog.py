"""cs3ray.ckpt.catalog in process (no CLI, no Ray): RUN/STEP targets, listing, the verify sweep."""

import pytest

from cs3ray.ckpt import CheckpointError, CheckpointManager, list_checkpoints, resolve_target, verify_checkpoints

from helpers.ckpt_runs import newest_only_chunk, save, small_model


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run with checkpoints at steps 3 and 4, written as training writes them."""
    path = tmp_path_factory.mktemp("catalog") / "run"
    mgr = CheckpointManager(str(path), keep=3)
    model = small_model()
    save(mgr, model, 3)
    save(mgr, small_model(seed=1), 4)  # other weights: step 4 writes chunks that step 3 lacks
    return path


def test_resolve_target(run, tmp_path, monkeypatch):
    assert resolve_target(f"{run}/4").rstrip("/").endswith("run/step-00000004")
    assert resolve_target(str(run)) == str(run)
    monkeypatch.chdir(tmp_path)
    assert resolve_target("myrun/7").rstrip("/").endswith("runs/myrun/step-00000007")  # a name means runs/<name>
    (tmp_path / "data" / "12").mkdir(parents=True)
    assert resolve_target("data/12") == "data/12"  # an existing folder is not read as RUN/STEP


def test_list_checkpoints(run, tmp_path):
    listing = list_checkpoints(str(run))
    rows = listing["checkpoints"]
    assert [r["step"] for r in rows] == [3, 4]
    assert rows[1]["url"].rstrip("/").endswith("step-00000004") and rows[1]["world_size"] == 1
    assert rows[0]["chunks"] > 0 and rows[0]["bytes_total"] > 0
    with pytest.raises(CheckpointError, match="does not exist"):
        list_checkpoints(str(tmp_path / "nope"))


def test_verify_checkpoints(run, tmp_path):
    seen = []
    results = verify_checkpoints(str(run), on_result=seen.append)
    assert seen == results and [(r["ok"], r["step"]) for r in results] == [(True, 3), (True, 4)]
    assert [r["step"] for r in verify_checkpoints(f"{run}/3")] == [3]
    chunk = newest_only_chunk(run, 4, 3)
    good = chunk.read_bytes()
    chunk.write_bytes(b"x" + good[1:])
    try:
        # A damaged checkpoint is a result naming it, not an exception; the older one still verifies.
        ok, bad = verify_checkpoints(str(run))
        assert ok["ok"] and not bad["ok"] and "step-00000004" in bad["url"]
        assert chunk.name in bad["error"] and "checksum" in bad["error"]
    finally:
        chunk.write_bytes(good)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no complete checkpoint to verify"):
        verify_checkpoints(str(tmp_path / "empty"))

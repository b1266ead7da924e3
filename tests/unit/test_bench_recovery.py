"""`cs3 bench recovery`'s kill schedule and its peer's stop file (the kills themselves: the bench)."""

from cs3ray.bench.ray_train_peer import last_step, stop_after
from cs3ray.bench.recovery import next_kill, plan


def test_every_kill_comes_at_the_first_kills_place_in_the_snapshot_interval_after_a_snapshot():
    # First kill after step 17 (2 past the step-15 snapshot); back at full size at 19 -> a snapshot at 20
    # and the next kill after 27, 2 past the step-25 one.
    assert next_kill(19, 17, 5) == 27
    assert next_kill(22, 17, 5) == 27
    assert next_kill(23, 17, 5) == 32  # 28 is past the place: the next interval's
    assert all(next_kill(f, 17, 5) % 5 == 2 and next_kill(f, 17, 5) >= f + 5 for f in range(17, 60))


def test_the_default_run_has_three_rounds_and_quick_two():
    assert plan(False)["rounds"] == 3 and plan(True)["rounds"] == 2
    assert plan(False)["first_kill"] > 2 * plan(False)["every"]


def test_the_peer_stops_after_the_step_in_its_stop_file(tmp_path):
    f = str(tmp_path / "stop")
    assert stop_after(None) == float("inf") and stop_after(f) == float("inf")
    last_step(f, 42)
    assert stop_after(f) == 42
    last_step(f, 50)
    assert stop_after(f) == 50 and not (tmp_path / "stop.tmp").exists()

"""`cs3 validate`'s verdicts: a figure measured over rounds PASSes only when its interval clears the target;
a single event is judged by its figure; the JSON has every numeric target's figure, interval and verdict."""

import math

from cs3ray.bench import validate


def test_pass_needs_the_interval_on_the_good_side_of_the_target():
    clear = validate.judged("serve_p99_itl", "ms", "p99_itl_ms", {"at_most": 50.0}, [20.0, 22.0, 21.0], "3 replays")
    assert clear.passed and clear.verdict == "met" and clear.figure == 21.0
    assert clear.interval[0] < 21.0 < clear.interval[1] < 50.0 and clear.target == "<= 50 ms"
    # Rounds either side of the target: FAIL, and the detail says why.
    straddle = validate.judged("serve_p99_itl", "ms", "p99_itl_ms", {"at_most": 50.0}, [30.0, 60.0, 45.0], "")
    assert not straddle.passed and straddle.verdict == "inconclusive" and "straddles" in straddle.detail
    low = validate.judged("collective_busbw", "of p2p", "bw_utilization", {"at_least": 0.8}, [0.5, 0.52, 0.51], "",
                          difference=False)
    assert not low.passed and low.verdict == "not met"


def test_a_single_event_is_judged_by_its_figure_and_a_failed_item_is_inconclusive():
    recovery = validate.judged("recovery", "s", "recovery_s", {"at_most": 300.0}, [8.6], "SIGKILL")
    assert recovery.passed and recovery.interval == [8.6, 8.6] and recovery.verdict == "met"
    nothing = validate.judged("storage_read", "MB/s", "read_mb_per_s", {"at_least": 100.0}, [math.nan], "")
    assert not nothing.passed and nothing.figure is None and nothing.verdict == "inconclusive"


def test_the_json_lists_every_numeric_target_with_its_verdict():
    checks = [validate.judged("recovery", "s", "recovery_s", {"at_most": 300.0}, [8.6], ""),
              validate.judged("training_mfu", "of peak", "mfu", {"at_least": 0.1}, [0.18, 0.2, 0.19], ""),
              validate.Check("versions", True, 1.0, "nodes", "the same everywhere")]
    r = validate.figures(checks)
    assert r["targets"] == {"recovery_s": {"at_most": 300.0}, "mfu": {"at_least": 0.1}}
    assert r["verdicts"] == {"recovery_s": "met", "mfu": "met"} and len(r["mfu_interval"]) == 2
    rows = validate.rows({"checks": {c.name: validate.asdict(c) for c in checks}})
    assert [row[:3] for row in rows] == [("recovery", "PASS", "met"), ("training_mfu", "PASS", "met"),
                                         ("versions", "PASS", "")]
    assert rows[1][3].startswith("0.19 [") and rows[0][3] == "8.6 s"

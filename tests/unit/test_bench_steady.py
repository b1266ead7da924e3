"""Where a bench's run reaches its steady state (cs3ray.bench.steady): from its step times, by one rule for every mode."""

from __future__ import annotations

import pytest

from cs3ray.bench.steady import drift, steady_part


def test_the_slow_first_steps_are_the_warm_up():
    times = [3.0, 1.6, 1.2, 1.0, 1.01, 0.99, 1.0, 1.02, 0.98, 1.0]
    part = steady_part(times, least=4)
    assert part.steady and part.start == 2 and part.steps == 8 and part.seconds == pytest.approx(sum(times[2:]))
    assert part.rate(100) == pytest.approx(100 * 8 / sum(times[2:]))


def test_a_step_known_to_differ_is_skipped_and_one_outlier_does_not_move_a_median():
    times = [1.0, 5.0, 1.0, 1.0, 1.0, 1.0, 1.0, 3.0, 1.0, 1.0]
    assert steady_part(times, least=4, first=2).start == 2
    assert drift([1.0, 1.0, 9.0, 1.0, 1.0, 1.0], 0) == 0.0


def test_a_rate_that_keeps_climbing_is_measured_at_its_end_and_flagged():
    times = [2.0 * 0.9 ** i for i in range(12)]  # 10% faster every step: never within 5%
    part = steady_part(times, least=4)
    assert not part.steady and (part.start, part.steps) == (8, 4)


def test_too_few_steps_are_refused():
    with pytest.raises(ValueError, match="fewer than 4"):
        steady_part([1.0, 1.0, 1.0], least=4)

"""`cs3 bench train`: the steps of every run that fit its time budget, and the pipeline's theoretical bubble."""

import pytest

from cs3ray.bench.train import MAX_STEPS, MIN_STEPS, bubble_theoretical, steps_per_run


def test_bench_steps_fit_the_budget():
    assert steps_per_run(0.5, 250, 12) == MAX_STEPS  # fast steps: the most steps
    assert steps_per_run(30, 250, 12) == MIN_STEPS  # slow steps: the fewest that can find a steady state
    steps = steps_per_run(2.0, 250, 12)
    assert MIN_STEPS <= steps and 12 * steps * 2.0 <= 250


def test_the_theoretical_bubble_of_each_schedule():
    assert bubble_theoretical(2, 8) == pytest.approx(1 / 9)
    assert bubble_theoretical(2, 8, virtual=2) == pytest.approx(1 / 17)

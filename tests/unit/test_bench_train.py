"""`cs3 bench train`: the warm-up and measured steps that fit its time budget."""

from cs3ray.bench.train import steps_for_budget


def test_bench_steps_fit_the_budget():
    assert steps_for_budget(1.5, 420, 5) == (3, 15)  # fast steps: the full run
    warmup, steps = steps_for_budget(30, 420, 5)  # 30 s steps: the fewest that still measure
    assert (warmup, steps) == (1, 2)
    warmup, steps = steps_for_budget(6, 420, 5)
    assert 5 * (warmup + steps) * 6 <= 420 + 5 * 6

"""The measured matmul peak that MFU divides by: positive, and within its time budget for a slow dtype."""

from cs3ray.core.peak import measure_peak


def test_peak_is_measured_and_positive():
    import torch

    assert measure_peak(torch.float32, 1, size=256, seconds=0.1) > 1e8


class _Clock:
    """A clock that advances `tick` seconds whenever it is read: every product seems to take about that long."""

    def __init__(self, tick: float) -> None:
        self.now, self.tick = 0.0, tick

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def _products(monkeypatch, tick: float, seconds: float) -> int:
    import torch

    from cs3ray.core import peak

    count = 0
    real = peak._product

    def counted(a, b):
        nonlocal count
        count += 1
        return real(a, b)

    monkeypatch.setattr(peak, "_product", counted)
    assert measure_peak(torch.float16, 1, size=32, seconds=seconds, clock=_Clock(tick)) > 0
    return count


def test_a_slow_dtype_keeps_the_peak_measurement_near_its_budget(monkeypatch):
    # fp16 products are emulated on most CPUs (and slow on all): a worker training in fp16 measures
    # its peak with one warm-up and single timed products, not seven products whatever they cost.
    # The clock is injected: the budget logic is checked, not this host's speed.
    assert _products(monkeypatch, tick=1.0, seconds=2.0) <= 3
    # A fast dtype: three warm-ups, then products timed four at a time.
    fast = _products(monkeypatch, tick=0.01, seconds=0.1)
    assert fast > 3 and (fast - 3) % 4 == 0


def test_cpu_features_name_the_instruction_sets_that_set_matmul_speed(tmp_path):
    from cs3ray.core.peak import cpu_features

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n"
                    "processor\t: 1\nflags\t\t: fpu sse avx2 avx512f avx512_bf16 amx_tile amx_bf16\n")
    assert cpu_features(str(info)) == ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]
    assert cpu_features(str(tmp_path / "missing")) == []

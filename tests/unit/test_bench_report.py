"""A benchmark whose measured work fails exits 1 and names the first error (2 stays bad input)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from cs3ray.bench import serve as serve_bench
from cs3ray.bench.serve_load import Item, replay, summarize
from cs3ray.ops.ports import free_port
from cs3ray_cli.main import app


def _all_failed() -> dict:
    """`cs3 bench serve`'s result when every request fails: real requests to a port nothing listens on."""
    url = f"http://127.0.0.1:{free_port()}"
    cells = {str(c): serve_bench._clean(summarize([replay(url, "m", [Item(0.0, "def", 8, i) for i in range(c)])]))
             for c in (1, 4)}
    return {**serve_bench._summary({m: cells for m in serve_bench.MODES}), "ingress": "serve proxy"}


def test_serve_bench_whose_requests_all_failed_exits_1_naming_the_first_error(monkeypatch):
    failed = _all_failed()
    assert failed["modes"]["continuous"]["4"]["tokens_per_s"] == 0  # what used to be printed, with exit 0
    monkeypatch.setattr(serve_bench, "run", lambda **kwargs: failed)
    res = CliRunner().invoke(app, ["bench", "serve", "--quick", "--json"])
    assert res.exit_code == 1, res.output
    assert "bench serve: the measured work failed at modes/unbatched/1: 1 failed, first error: ClientConnectorError" \
        in " ".join(res.output.split())
    assert "Traceback" not in res.output and not res.stdout.strip().startswith("{")  # no table of zeros, no JSON


def test_an_error_raised_by_the_measured_work_exits_1_and_bad_input_exits_2(monkeypatch):
    from cs3ray.bench import train as train_bench
    from cs3ray.train.driver import TrainingError

    def crash(*args, **kwargs):
        raise TrainingError("RuntimeError: Expected both inputs to be Half, Float or Double tensors")
    monkeypatch.setattr(train_bench, "run", crash)
    res = CliRunner().invoke(app, ["bench", "train", "--quick"])
    assert res.exit_code == 1 and "TrainingError: RuntimeError: Expected both inputs" in " ".join(res.output.split())
    bad = CliRunner().invoke(app, ["bench", "ckpt", "--quick", "--config", "no-such.yaml"])
    assert bad.exit_code == 2 and "Traceback" not in bad.output
    assert "1 the measured work failed" in " ".join(CliRunner().invoke(app, ["bench", "serve", "--help"]).output.split())
    ok = CliRunner().invoke(app, ["bench", "peak", "--quick", "--threads", "1", "--json"])
    assert ok.exit_code == 0 and "fp32_flops" in json.loads(ok.stdout.strip().splitlines()[-1])

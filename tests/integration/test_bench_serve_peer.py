"""`cs3 bench serve --peer vllm --quick` end to end: the built-in engine, vLLM's own OpenAI server and
serve.engine=vllm under one workload on the same cores, with the peer's keys in the JSON.

Skipped where vLLM is not installed (the dev extra does not carry it: see docs/operations.md for how to run it).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm")

from conftest import run_cs3  # noqa: E402

pytestmark = pytest.mark.slow


TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


@pytest.mark.parametrize("dtype", list(TORCH_NAMES))
def test_bench_serve_peer_vllm_quick(tmp_path, dtype):
    proc = run_cs3(["bench", "serve", "--quick", "--peer", "vllm", "--dtype", dtype, "--json"], cwd=tmp_path,
                   timeout=1200)
    assert proc.returncode == 0, proc.stderr[-2000:]  # 1 would name the first failed request
    r = json.loads(proc.stdout.splitlines()[-1])
    peer = r["peer"]
    assert r["dtype"] == dtype and peer["engine_args"]["dtype"] == TORCH_NAMES[dtype]  # every side's precision
    assert peer["cores"] and set(peer["sides"]) == {"builtin", "vllm", "serve_vllm"}
    for side in peer["sides"].values():
        assert set(side) == {"1", "4", "16", "64"} and all(cell["errors"] == 0 for cell in side.values())
    assert r["vllm_tokens_per_s_at_16"] > 0 and r["vllm_p99_itl_ms_at_16"] > 0
    assert r["builtin_vs_vllm_at_16"] > 0 and r["serve_vllm_vs_vllm_at_16"] > 0
    assert len(r["builtin_vs_vllm_at_16_rounds"]) == peer["rounds_at_16"] == 2
    for key in ("builtin_vs_vllm_at_16", "serve_vllm_vs_vllm_at_16", "builtin_p99_itl_ms_at_16"):
        assert r["verdicts"][key] in ("met", "not met", "inconclusive") and key in r["targets"]

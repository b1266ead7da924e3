"""Elastic scaling on simulated nodes: shrink to min when a node is lost, grow back when it returns."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT


@pytest.mark.slow
def test_node_loss_shrinks_to_min_and_node_return_grows_back(tmp_path):
    proc = subprocess.run([sys.executable, "tests/scenarios/elastic.py", str(tmp_path / "elastic")], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    sizes = [s["workers"] for s in result["starts"] if s["event"] == "start"]
    assert sizes[0] == 2 and 1 in sizes and sizes[-1] == 2
    one = next(s for s in result["starts"] if s["event"] == "start" and s["workers"] == 1)
    # The global batch is kept: one worker accumulates what two computed.
    assert (one["micro_batch"], one["grad_accum"]) == (8, 2)
    restored = [s for s in result["starts"] if s["event"] == "restored"]
    assert len(restored) >= 2 and all(s["step"] > 0 for s in restored)
    assert result["summary"]["stopped_early"] and result["summary"]["steps"] > restored[-1]["step"]

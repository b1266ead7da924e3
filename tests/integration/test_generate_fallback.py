"""`cs3 generate` as a user runs it, on a run whose newest checkpoint has one corrupt chunk."""

import os

from cs3ray.ckpt import CheckpointManager

from conftest import run_cs3
from helpers.ckpt_runs import flip_byte, newest_only_chunk, save, small_model


def test_generate_falls_back_to_the_previous_checkpoint_with_one_warning_line(tmp_path):
    run = tmp_path / "run"
    mgr = CheckpointManager(str(run), keep=3)
    save(mgr, small_model(1), 1)
    save(mgr, small_model(2), 2)
    chunk = newest_only_chunk(run, 2, 1)
    flip_byte(chunk)
    # Every warning shown, so one meant for library developers would be seen here.
    proc = run_cs3(["generate", str(run), "--prompt", "def ", "--max-tokens", "4", "--seed", "0"],
                   env={**os.environ, "PYTHONWARNINGS": "always"}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ")
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"checkpoint {run / 'step-00000002'} refused (chunk '") and chunk.name in lines[0]
    assert lines[0].endswith(f"using {run / 'step-00000001'}")
    assert "Traceback" not in proc.stderr and "torch.distributed is disabled" not in proc.stderr

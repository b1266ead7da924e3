"""run.log_format=json on the session's head: every line the driver and the workers of a short `cs3 train` write
is one JSON object with the fields an index needs (deploy/logging/)."""

from __future__ import annotations

import datetime
import json
import uuid
from pathlib import Path

from cs3ray.ops.json_logs import FIELDS, LOG_DIR

from conftest import run_cs3

STEPS = 4


def json_lines(path: Path) -> list[dict]:
    lines = path.read_text().splitlines()
    assert lines, f"{path} is empty"
    out = []
    for line in lines:
        record = json.loads(line)  # every line, not only most
        assert isinstance(record, dict) and set(FIELDS) <= set(record), (path.name, line)
        datetime.datetime.strptime(record["timestamp"], "%Y-%m-%dT%H:%M:%S.%fZ")
        assert record["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL") and record["job_id"]
        out.append(record)
    return out


def test_a_json_run_writes_json_lines_from_the_driver_and_every_worker(ray_head, ray_client, tmp_path):
    name = f"jsonlog-{uuid.uuid4().hex[:8]}"
    run_cs3(["train", "configs/tiny.yaml", f"run.dir={tmp_path / 'run'}", f"run.name={name}", "run.log_format=json",
             "model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
             "train.batch_size=4", f"train.steps={STEPS}", "train.warmup_steps=0", "train.log_every=2",
             f"train.eval_every={STEPS}", f"checkpoint.every={STEPS}", "cluster.workers=2", "precision=fp32",
             "--address", ray_head.address, "--json"], env=ray_head.env(), check=True)
    # The head's session on this machine: the driver ran here, and so did both workers.
    logs = Path(ray_client._private.worker._global_node.get_logs_dir_path()) / LOG_DIR
    driver = list(logs.glob(f"driver-{name}-*.log"))
    workers = list(logs.glob(f"worker-{name}-*.log"))
    assert len(driver) == 1 and len(workers) == 2, sorted(p.name for p in logs.iterdir())

    lines = json_lines(driver[0])
    assert {r["run"] for r in lines} == {name} and {r["rank"] for r in lines} == {None}
    assert len({r["job_id"] for r in lines}) == 1 and all(r["node"] for r in lines)
    # Each worker event as a line at its step: progress every log_every steps, the final checkpoint, the end.
    progress = [r for r in lines if r.get("event") == "progress"]
    assert [r["step"] for r in progress] == [2, 4] and progress[-1]["message"].startswith("progress step=4 loss=")
    assert any(r.get("event") == "checkpoint" and r["step"] == STEPS for r in lines)
    assert lines[-1]["event"] == "end"

    ranks = set()
    for path in workers:
        lines = json_lines(path)
        assert {r["run"] for r in lines} == {name} and len({r["rank"] for r in lines}) == 1
        ranks.add(lines[0]["rank"])
        # The step of each line is the step the worker was at: the first line at 0, the last at the end.
        # (Ray Train's own records in this process land here too, with the same fields.)
        assert lines[0]["step"] == 0 and lines[-1]["step"] == STEPS
        assert any(r["message"] == f"rank {r['rank']} ends at step {STEPS}" for r in lines)
        assert [r["step"] for r in lines if r["message"].startswith("step ")] == [2, 4]
        assert any(r["message"].startswith(f"checkpoint of step {STEPS}") for r in lines)
    assert ranks == {0, 1}

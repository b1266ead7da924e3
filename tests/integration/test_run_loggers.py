"""`run.loggers`: a short `cs3 train` also logs its figures to TensorBoard event files in the run directory and
to an MLflow run (a local tracking store), read back with each tool's own reader; a missing package is one line."""

from __future__ import annotations

import struct

import pytest

from cs3ray.config import load_config
from cs3ray.errors import UserError
from cs3ray.ops import run_loggers

from conftest import ROOT, run_cs3

SMALL = ["model.dim=64", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=128", "train.seq_len=32",
         "train.batch_size=4", "train.steps=4", "train.warmup_steps=0", "train.log_every=1", "train.eval_every=2",
         "train.eval_batches=1", "checkpoint.every=2", "cluster.workers=1", "data.max_bytes=200000", "precision=bf16"]


def tensorboard_scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a folder's TensorBoard event files (TFRecord frames of Event protos)."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(folder.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at:at + 8])
            event = Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


@pytest.mark.slow
def test_a_run_logs_to_tensorboard_and_mlflow(ray_head, tmp_path, monkeypatch):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local store for the test; users run a server

    run_dir, store = tmp_path / "logged", tmp_path / "mlruns"
    env = dict(ray_head.env(), MLFLOW_TRACKING_URI=f"file://{store}", MLFLOW_ALLOW_FILE_STORE="true")
    run_cs3(["train", "configs/tiny.yaml", f"run.dir={run_dir}", "run.name=logged", *SMALL,
             "run.loggers=[tensorboard, mlflow]", "run.mlflow_experiment=cs3-test", "--address", ray_head.address],
            env=env, check=True)

    scalars = tensorboard_scalars(run_dir / "tensorboard")
    assert [step for step, _ in scalars["cs3/loss"]] == [1, 2, 3, 4]
    assert [step for step, _ in scalars["cs3/val_loss"]] == [0, 2, 4]
    assert {"cs3/tokens_per_s", "cs3/mfu", "cs3/grad_norm", "cs3/checkpoint_save_s"} <= scalars.keys()

    client = mlflow.tracking.MlflowClient(f"file://{store}")
    (run,) = client.search_runs([client.get_experiment_by_name("cs3-test").experiment_id])
    assert run.info.run_name == "logged" and run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "4" and run.data.params["precision"] == "bf16"
    losses = client.get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in losses] == [1, 2, 3, 4]
    assert [m.value for m in losses] == pytest.approx([v for _, v in scalars["cs3/loss"]], rel=1e-6)


def test_a_logger_whose_package_is_missing_is_one_clear_error(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else real(name, *a))
    cfg = load_config(ROOT / "configs/tiny.yaml", ["run.loggers=[mlflow]"])
    with pytest.raises(UserError, match=r"^run.loggers names mlflow, but mlflow is not installed here \(pip install mlflow\)$"):
        run_loggers.check_loggers(cfg)

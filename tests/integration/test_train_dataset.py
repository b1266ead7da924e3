"""Bring your own Ray Dataset: `cs3ray.train.train(cfg, dataset=ds)` trains 2 workers on a user's dataset of token
rows through Ray Train's `streaming_split`; a resume says plainly that the epoch starts over; bad rows and
combinations that need the global order are one clear error."""

from __future__ import annotations

import json
import logging

import numpy as np
import pytest

from cs3ray.config import load_config
from cs3ray.data.dataset_stream import DatasetStream
from cs3ray.errors import UserError

from conftest import ROOT

SEQ = 32
TEXT = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(600)).encode()


def _dataset(ray, width=SEQ + 1, text=TEXT):
    """What a Ray user would build: text -> byte ids -> fixed-length rows in a 'tokens' column."""
    ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
    rows = ids[: len(ids) // width * width].reshape(-1, width)
    return ray.data.from_numpy(rows).map_batches(lambda b: {"tokens": b["data"]}, batch_format="numpy")


def _cfg(run_dir, *extra):
    return load_config(ROOT / "configs/tiny.yaml", [
        f"run.dir={run_dir}", f"train.seq_len={SEQ}", "train.batch_size=8", "train.warmup_steps=2",
        "train.log_every=2", "train.eval_every=100", "train.eval_batches=2", "checkpoint.every=100",
        "precision=fp32", *extra])  # a later precision= in `extra` wins


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_a_users_dataset_trains_on_two_workers_with_int8_gradients(ray_client, ray_head, tmp_path, precision):
    from cs3ray.train import train

    run_dir = tmp_path / "byo"
    summary = train(_cfg(run_dir, "train.steps=6", "compression.codec=int8", "compression.warmup_steps=0",
                         f"precision={precision}"),
                    dataset=_dataset(ray_client), address=ray_head.address, quiet=True)
    assert summary["steps"] == 6 and summary["workers"] == 2 and summary["precision"] == precision
    assert summary["final_val_loss"] < summary["initial_val_loss"] - 0.5  # it learns from the rows it is given
    # Compressed sync: the bytes a rank sent each step, reported as it trains and in the summary.
    progress = [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
                if '"progress"' in line]
    # Each worker process syncs its first step in fp32 (DDP's initial buckets), every later one in int8.
    per = [e["comm_bytes_per_step"] for e in progress]
    assert len(progress) == 3 and per[0] > per[1] == per[2] > 0
    fp32 = 2 * per[0] - per[1]
    assert 0.25 < per[1] / fp32 < 0.27
    assert progress[-1]["wire_ratio"] == pytest.approx((fp32 + 5 * per[1]) / (6 * fp32), rel=0.01)
    per_step = summary["compression"]["bytes_per_step_per_rank"]
    assert summary["compression"]["codec"] == "int8" and per_step == pytest.approx(sum(per) / 3, rel=0.01)


def test_a_resumed_dataset_stream_says_its_epoch_starts_over_and_epochs_follow_one_another(ray_client, caplog):
    ds = _dataset(ray_client)
    rows = ds.count()
    first = np.stack(ds.take_batch(4, batch_format="numpy")["tokens"])
    with caplog.at_level(logging.WARNING):
        stream = DatasetStream(ds.iterator(), 4, SEQ + 1, 259, position={"source": "dataset", "samples": 96})
    assert "the dataset's epoch starts over" in caplog.text
    np.testing.assert_array_equal(next(stream), first)  # the epoch's first rows again, as Ray Train would give
    for _ in range(rows // 4):  # past the end of the epoch: the next one starts
        next(stream)
    assert stream.epoch == 1 and stream.state()["samples"] == 96 + (rows // 4 + 1) * 4
    stream.close()


def test_bad_rows_and_global_order_settings_are_one_clear_error(ray_client, ray_head, tmp_path):
    from cs3ray.train import train

    cases = [
        (_dataset(ray_client, width=SEQ), [], r"rows of \(32,\) tokens, expected 33"),
        (ray_client.data.from_items([{"text": "hello"}] * 40), [], "no 'tokens' column"),
        (_dataset(ray_client, text=bytes(range(200, 256)) * 40).map_batches(lambda b: {"tokens": b["tokens"] * 2}),
         [], "token id 510 is outside model.vocab_size=264"),
        (_dataset(ray_client), ["cluster.fault_tolerance=replicas"], "re-splits every step's samples"),
        (_dataset(ray_client), ["data.loader=ray_data"], "apply to shard sets"),
    ]
    for i, (ds, extra, message) in enumerate(cases):
        with pytest.raises(UserError, match=message):
            train(_cfg(tmp_path / f"bad{i}", "train.steps=2", *extra), dataset=ds, address=ray_head.address, quiet=True)

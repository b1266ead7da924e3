"""What a run writes locally is its owner's alone: 0600 files, 0700 folders, with no process-wide umask.

The real writers, without Ray: a run directory's config, events, summary and TensorBoard files,
a checkpoint through DCP with a large chunk (O_DIRECT) and a replica, prepared shards, the
node's shard cache (its files, locks and statistics).
"""

from __future__ import annotations

import os
import stat

import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import load_config
from cs3ray.data.cache import TieredCache
from cs3ray.ops.events import EventLog
from cs3ray.ops.run_loggers import TensorBoardLogger
from cs3ray.storage import open_url

from helpers.modes import not_private
from helpers.shard_sets import make_shard_set


def test_run_files_checkpoints_shards_and_the_cache_are_the_owners_alone(tmp_path):
    umask = os.umask(0o022)  # the usual umask: group and others could read what it lets through
    try:
        run = open_url(str(tmp_path / "out" / "runs" / "tiny"))  # "out", "runs" and "tiny" are created here
        run.makedirs()
        run.write_text("model: {}\n", "config.yaml")
        log = EventLog(run)
        log.add({"event": "start"})
        log.flush()
        log.add({"event": "progress"})
        log.flush()
        run.write_text("{}", "summary.json")
        board = TensorBoardLogger(load_config(None), run)
        board.observe({"event": "progress", "step": 1, "loss": 2.5})
        board.close()
        manager = CheckpointManager(run.url, keep=1, replicas=[str(tmp_path / "out" / "replica")])
        big = torch.ones(2 << 20 >> 2)  # 2 MiB: the O_DIRECT path of a chunk
        manager.save(1, {"w": big, "b": torch.ones(4)}, {"step": 1}, {}, {"config.yaml": "model: {}\n"})
        manager.close()

        src, manifest = make_shard_set(tmp_path / "shards", n_shards=2)  # its corpus file: the user's, beside it
        entries = manifest["splits"]["train"]
        with TieredCache(open_url(src), entries, memory_bytes=0, disk_bytes=10**8,
                         disk_dir=str(tmp_path / "out" / "l2")) as cache:
            for e in entries:
                cache.get(e["file"])
            cache.writer.flush()
        written = {p.relative_to(tmp_path / "out").parts[0] for p in (tmp_path / "out").rglob("*") if p.is_file()}
        assert {"runs", "replica", "l2"} <= written and (tmp_path / "shards" / "manifest.json").is_file()
        assert (tmp_path / "out" / "runs" / "tiny" / "step-00000001" / "manifest.json").is_file()
        assert any((tmp_path / "out" / "runs" / "tiny" / "tensorboard").iterdir())
        assert not_private(tmp_path / "out") == [] and not_private(tmp_path / "shards") == []
        assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == stat.S_IMODE((tmp_path / "shards").stat().st_mode) \
            == 0o700
        # Nothing changed the process's umask: files others create (Ray's logs) keep their modes.
        assert os.umask(0o022) == 0o022
        (tmp_path / "plain.log").write_text("x")
        assert stat.S_IMODE((tmp_path / "plain.log").stat().st_mode) == 0o644
    finally:
        os.umask(umask)

"""Error-feedback residuals through a real checkpoint on 2 gloo ranks: a resumed core takes up the saved
residuals under the keys of DDP's rebuilt buckets (its first sync, in DDP's initial buckets, runs in fp32 and
leaves them untouched); after a resize (no per-rank file for the new world) or a codec change they start
from zero with a warning, and training goes on."""

import logging

import numpy as np
import pytest
import torch

from cs3ray.ckpt.manager import CheckpointManager
from cs3ray.config import load_config
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology

from helpers.core import MODEL, global_batches
from helpers.ranks import gloo_ranks

WORLD = 2


PRECISIONS = ("fp32", "bf16", "fp16")


def _core(rank: int, world: int, codec: str, precision: str) -> ComputeCore:
    cfg = load_config(None, MODEL + [f"cluster.workers={world}", f"compression.codec={codec}", f"precision={precision}",
                                     "compression.warmup_steps=0"])
    return ComputeCore(cfg, torch.device("cpu"), Topology(rank, world, 1, ("n0",) * world))


def _step(core: ComputeCore, batch: np.ndarray, rank: int) -> float:
    per = len(batch) // WORLD
    return core.step(lambda rows=batch[rank * per:(rank + 1) * per]: rows, lr=1e-2)[0]


def _resume_all(rank: int, world: int, results: dict, root: str) -> None:
    """Each precision in turn, in one process group."""
    for precision in PRECISIONS:
        results[precision] = {}
        _resume(rank, world, results[precision], f"{root}/{precision}", precision)


def _resume(rank: int, world: int, results: dict, root: str, precision: str) -> None:
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("cs3ray.core.engine").addHandler(handler)
    batches = global_batches(4, rows=8)
    core = _core(rank, world, "int8", precision)
    for batch in batches[:2]:
        _step(core, batch, rank)
    mgr = CheckpointManager(root, keep=1)
    saved = core.compression_state()
    mgr.save(2, core.state(), {"step": 2}, {"compression": saved}, {})
    mgr.wait()
    results["saved"] = {str(k): v.numpy().copy() for k, v in saved["residuals"].items()}
    results["continued"] = [_step(core, batch, rank) for batch in batches[2:]]
    for name, codec, drop_file in (("resumed", "int8", False), ("resized", "int8", True),
                                   ("recoded", "int4_sparse", False)):
        fresh = _core(rank, world, codec, precision)
        state = fresh.state()
        step, _meta, rank_state = mgr.load(state)
        fresh.after_load(state)
        warnings.clear()
        # After a world-size change the manager finds no per-rank file for this rank and hands None.
        fresh.load_compression_state(None if drop_file else rank_state["compression"], step)
        got = results[name] = {"residual_bytes": fresh.memory()["residual_bytes"], "warnings": list(warnings),
                               "syncs": fresh.compression.steps, "losses": [_step(fresh, batches[2], rank)]}
        residuals = fresh.compression.reduce.feedback.residuals
        got["after_first"] = {str(k): v.numpy().copy() for k, v in residuals.items()}
        got["losses"].append(_step(fresh, batches[3], rank))
        got["after_second"] = {str(k): v.numpy().copy() for k, v in residuals.items()}
        got["wire_ratio"] = fresh.comm_stats()["wire_ratio"]
    mgr.close()
    logging.getLogger("cs3ray.core.engine").removeHandler(handler)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    results = gloo_ranks(_resume_all, WORLD, str(tmp_path_factory.mktemp("run")), timeout=300)
    for r in results.values():
        assert "error" not in r, r.get("error")
    return results


@pytest.mark.parametrize("precision", PRECISIONS)
def test_residuals_survive_a_checkpoint_and_restart_from_zero_after_a_resize(runs, precision):
    for rank, by_precision in runs.items():
        r = by_precision[precision]
        saved, resumed = r["saved"], r["resumed"]
        assert saved and resumed["residual_bytes"] > 0 and resumed["syncs"] == 2 and not resumed["warnings"]
        # The first sync of the process, in DDP's initial buckets, is fp32 and leaves the residuals as saved ...
        assert resumed["after_first"].keys() == saved.keys(), rank
        assert all(np.array_equal(resumed["after_first"][k], saved[k]) for k in saved), rank
        # ... and the second, in the rebuilt buckets the residuals were saved under, takes them up: no key is
        # new (a residual started afresh) and every saved one was used and changed.
        assert resumed["after_second"].keys() == saved.keys(), rank
        assert not any(np.array_equal(resumed["after_second"][k], saved[k]) for k in saved), rank
        assert resumed["losses"][0] == r["continued"][0] and all(np.isfinite(resumed["losses"]))
        for name in ("resized", "recoded"):
            got = r[name]
            assert got["residual_bytes"] == 0 and got["syncs"] == 2, (name, got)
            assert any("residuals start from zero at step 2" in w for w in got["warnings"]), (name, got)
            assert got["after_first"] == {} and got["after_second"], name  # fresh residuals from the second sync
            assert all(np.isfinite(got["losses"])), (name, got)
        # One fp32 sync and one int8 sync since the resume: their mean ratio.
        assert 0.55 < resumed["wire_ratio"] < 0.7, resumed["wire_ratio"]

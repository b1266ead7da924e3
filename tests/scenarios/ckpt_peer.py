"""Run by test_ckpt_multinode.py in a subprocess (the test process may be connected to another Ray).

    python tests/scenarios/ckpt_peer.py save|restore ADDRESS RUN_DIR NODE_ID

`save`: one rank, pinned to NODE_ID, snapshots a model with the memory tier on; prints where
its keepers are. `restore`: a rank pinned to NODE_ID loads the newest snapshot into a fresh
model; prints the step, the tier it came from and whether every tensor matches.
"""

from __future__ import annotations

import json
import sys

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


def _model(seed: int):
    import torch

    from cs3ray.models import ModelArgs, Transformer

    torch.manual_seed(seed)
    return Transformer(ModelArgs(dim=64, n_layers=2, n_heads=4, ffn_dim=128, max_seq_len=32))


@ray.remote(num_cpus=0)
def save(run: str) -> dict:
    import torch

    from cs3ray.ckpt import CheckpointManager
    from cs3ray.ckpt.keeper import MemoryTier

    mgr = CheckpointManager(run, memory_tier=True)
    mgr.save(7, {"model": _model(1).state_dict()}, {"step": 7}, {"torch": torch.get_rng_state()}, {})
    mgr.close()
    tier = MemoryTier(mgr.run.url)
    return {"node": tier.node_id, "keepers": tier._targets()}


@ray.remote(num_cpus=0)
def restore(run: str) -> dict:
    import torch

    from cs3ray.ckpt import CheckpointManager

    fresh = _model(2)
    state = {"model": fresh.state_dict()}
    mgr = CheckpointManager(run, memory_tier=True)
    step, _, _ = mgr.load(state)
    want = _model(1).state_dict()
    same = all(torch.equal(state["model"][k], v) for k, v in want.items())
    return {"step": step, "source": mgr.last_restore.source, "same": same,
            "node": ray.get_runtime_context().get_node_id()}


def main(phase: str, address: str, run: str, node: str) -> None:
    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    task = {"save": save, "restore": restore}[phase]
    pin = NodeAffinitySchedulingStrategy(node, soft=False)
    print(json.dumps(ray.get(task.options(scheduling_strategy=pin).remote(run), timeout=240)))
    ray.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:5])

"""Fault-tolerant replicas (`cluster.fault_tolerance: replicas`): survivors keep training.

With Ray Train's TorchftConfig every worker is a replica group of one: its own
torch.distributed world holds just itself, and torchft's Manager averages gradients across
the replicas that are alive for a step (a quorum kept by the torchft lighthouse that Ray
Train starts). When a worker dies, the survivors' next quorum leaves it out after the
lighthouse's heartbeat timeout and they go on; Ray Train replaces only the dead replica
group, and the newcomer copies the live state from a survivor (torchft's healing, over the
same gloo group) before it joins. Ray Train's default instead restarts every worker from
the newest snapshot (see `cs3 bench recovery`).

Every step's global batch is split over that step's participants, so no sample is skipped
or repeated while the group is short of a replica: fewer replicas accumulate more.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any, Callable

import torch

from cs3ray.errors import UserError

# The lighthouse declares a replica dead after this long without a heartbeat (torchft's
# default is 5 s); replicas send one every 100 ms, so 1 s still tolerates long GC pauses.
HEARTBEAT_TIMEOUT_MS = 1000
# How long a quorum waits for a replica that was in the previous one before going on without it.
JOIN_TIMEOUT_MS = 1000
TIMEOUT = timedelta(seconds=60)  # collectives, healing transfers, commit votes


def lighthouse_kwargs() -> dict[str, Any]:
    """torchft lighthouse settings for Ray Train's TorchftConfig: one replica suffices to go on."""
    return {"min_replicas": 1, "heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS, "join_timeout_ms": JOIN_TIMEOUT_MS}


def torchft_config(backend: str):
    """Ray Train's TorchftConfig, or one clear sentence when torchft is not installed."""
    try:
        import torchft  # noqa: F401
        from ray.train.v2.torch.torchft_config import TorchftConfig
    except ImportError:
        raise UserError("cluster.fault_tolerance=replicas needs torchft: pip install 'cs3ray[ft]' "
                        "(or torchft), or use cluster.fault_tolerance=restart.") from None
    return TorchftConfig(lighthouse_kwargs=lighthouse_kwargs(), backend=backend)


def load_in_place(dst: Any, src: Any) -> None:
    """Copy a nested state dict's tensors into `dst`'s tensors in place (optimizer state has no setter)."""
    if isinstance(dst, dict):
        for key, value in dst.items():
            if isinstance(value, torch.Tensor):
                value.copy_(src[key])
            else:
                load_in_place(value, src[key])


class ReplicaSync:
    """One replica's view of the torchft quorum: who trains this step, gradient averaging, commits.

    `state_dict`/`load_state_dict` are the replica's whole training state (model, optimizer,
    run progress): what a survivor sends a newcomer that heals from it.
    """

    def __init__(self, replica: int, state_dict: Callable[[], dict], load_state_dict: Callable[[dict], None],
                 step: int) -> None:
        # torchft logs every quorum and commit at INFO (Rust and Python): several lines per step
        # in the user's terminal. Warnings still come through.
        os.environ.setdefault("RUST_LOG", "warn")
        logging.getLogger("torchft").setLevel(logging.WARNING)
        from torchft import Manager, ProcessGroupGloo
        from torchft.checkpointing.pg_transport import PGTransport

        pg = ProcessGroupGloo(timeout=TIMEOUT)
        self.manager = Manager(
            pg=pg, min_replica_size=1, load_state_dict=load_state_dict, state_dict=state_dict,
            world_size=1, rank=0, replica_id=f"cs3-{replica}", timeout=TIMEOUT, quorum_timeout=TIMEOUT,
            # A synchronous quorum heals a newcomer before its forward pass, so every step that
            # counts is computed from the same weights on every replica.
            use_async_quorum=False, init_sync=False,
            checkpoint_transport=PGTransport(pg, timeout=TIMEOUT, device=torch.device("cpu")))
        # A restored snapshot's step: replicas at an older step heal from one at the newest.
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def begin_step(self) -> tuple[int, int, int]:
        """Join this step's quorum (healing first if behind): (step, participant rank, participants)."""
        self.manager.start_quorum()
        return self.manager.current_step(), self.manager.participating_rank() or 0, self.manager.num_participants()

    def sync_grads(self, params: list[torch.Tensor]) -> None:
        """Average the gradients over this step's participants, in one flat buffer (one collective)."""
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        self.manager.allreduce(flat).wait()
        offset = 0
        for p, g in zip(params, grads, strict=True):
            n = g.numel()
            if p.grad is None:
                p.grad = g
            p.grad.copy_(flat[offset:offset + n].view_as(g))
            offset += n

    def average(self, values: list[float]) -> list[float]:
        """Mean of a few scalars over this step's participants."""
        t = torch.tensor(values, dtype=torch.float64)
        self.manager.allreduce(t).wait()
        return t.tolist()

    def commit(self) -> bool:
        """Whether every participant finished the step without a collective error (a vote)."""
        return self.manager.should_commit()

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

"""The training's torch process group, with its TCPStore bound to rank 0's node address only.

Ray Train's TorchConfig picks a free port on rank 0's node and lets torch.distributed start the
store there; torch 2.13 binds that server on every interface and takes no address for it. Here
rank 0 binds the listening socket itself, on its node's address (127.0.0.1 on a loopback cluster),
and hands it to the store (`master_listen_fd`); the other ranks connect to that address as before.
Holding the socket from the moment the port is chosen also closes the window in which another
process could take the port.

The backend also installs the preemption SIGTERM handler in every worker (train/preemption.py): only a
process's main thread may, and a worker actor runs `execute` there, not in the training thread.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Any

from ray.train.torch import TorchConfig
from ray.train.torch.config import _set_torch_distributed_env_vars, _TorchBackend

from .preemption import install_sigterm_handler

# Rank 0's bound listener, from `_listen` until `_join` hands it to the store (one actor = one process).
_LISTENER: socket.socket | None = None


def _listen() -> tuple[str, int]:
    """On rank 0: a listening socket on this node's address; (address, port)."""
    import ray

    global _LISTENER
    if _LISTENER is not None:
        _LISTENER.close()
    addr = ray.util.get_node_ip_address()
    sock = socket.socket(socket.AF_INET6 if ":" in addr else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((addr, 0))
    sock.listen(socket.SOMAXCONN)
    _LISTENER = sock
    return addr, sock.getsockname()[1]


def _join(backend: str, rank: int, world_size: int, addr: str, port: int, timeout_s: float) -> None:
    """Every rank: the store (rank 0 serves it on the bound socket), then the process group on it."""
    import torch.distributed as dist

    global _LISTENER
    timeout = timedelta(seconds=timeout_s)
    listen_fd = None
    if rank == 0:
        assert _LISTENER is not None, "rank 0 joins after _listen"
        listen_fd, _LISTENER = _LISTENER.detach(), None  # the store owns the descriptor from here
    if backend == "nccl":
        # As Ray's own setup: a timed-out NCCL collective fails the worker instead of hanging it.
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    store = dist.TCPStore(addr, port, world_size, rank == 0, timeout, master_listen_fd=listen_fd)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


class _BoundStoreBackend(_TorchBackend):
    def on_start(self, worker_group: Any, backend_config: TorchConfig) -> None:
        import ray

        backend = backend_config.backend or "gloo"
        addr, port = worker_group.execute_single(0, _listen)
        worker_group.execute(_set_torch_distributed_env_vars)  # LOCAL_RANK, RANK, WORLD_SIZE, as Ray sets them
        worker_group.execute(install_sigterm_handler)  # SIGTERM: a snapshot of the step, then the group ends
        n = len(worker_group)
        # Positional: execute_single_async's own first parameter is called `rank`.
        ray.get([worker_group.execute_single_async(i, _join, backend, i, n, addr, port, backend_config.timeout_s)
                 for i in range(n)])


class BoundStoreTorchConfig(TorchConfig):
    """Ray Train's TorchConfig whose store listens on rank 0's node address, not every interface."""

    @property
    def backend_cls(self) -> type[_BoundStoreBackend]:
        return _BoundStoreBackend

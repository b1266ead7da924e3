"""Reading a checkpoint back: the verified fallback that the trainer's restore and every reader share.

`restore` tries the candidates of `locations.restore_order` (memory -> primary -> replicas, newest
step first) and takes the first one whose files match the manifest and whose tensors load with
every chunk matching its hash. Called on every rank of a process group, all ranks take the same
candidate; in a single process (generate, serve, export) it is the same loop without collectives.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata

from cs3ray.errors import UserError
from cs3ray.storage import StorageError

from .chunks import METADATA
from .dcp_metadata import check_sizes, load_metadata
from .locations import MemoryLocation, restore_order
from .manifest import CheckpointError

log = logging.getLogger(__name__)
# What DCP warns on every save and load without a process group.
_NO_PROCESS_GROUP = "torch.distributed is disabled, unavailable or uninitialized"


def rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier(group: Any = None) -> None:
    if dist.is_initialized():
        dist.barrier(group=group)


def broadcast(obj: Any) -> Any:
    """Rank 0's value of `obj` on every rank."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_ok(ok: bool) -> bool:
    """True only when `ok` is true on every rank (so every rank takes the same fallback)."""
    if not dist.is_initialized():
        return ok
    t = torch.tensor([0.0 if ok else 1.0])
    dist.all_reduce(t)
    return float(t) == 0.0


def first_problem(problem: str | None) -> str:
    """The first rank's description of what went wrong (a rank that saw nothing itself has None)."""
    if dist.is_initialized():
        seen: list[str | None] = [None] * dist.get_world_size()
        dist.all_gather_object(seen, problem)
        problem = next((p for p in seen if p), None)
    return problem or "unreadable"


@contextlib.contextmanager
def single_process_quiet() -> Iterator[None]:
    """Hide DCP's no-process-group warning where one process is intended (generate, export, tests)."""
    if dist.is_initialized():
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_NO_PROCESS_GROUP, category=UserWarning)
        yield


def load_state(state: dict[str, Any], reader: Any) -> None:
    """dcp.load(state) in place, the reader's `.metadata` read (and checked) first; call it on every rank.

    DCP catches a failed metadata read, retries it as a per-rank file and logs both tracebacks; read
    here first (the reader keeps it), a refused or damaged `.metadata` is one CheckpointError on every
    rank. A CheckpointError the reader raises later (a damaged chunk) comes out as itself too.
    """
    problem: Exception | None = None
    try:
        reader.read_metadata()
    except UserError as exc:
        problem = exc
    except Exception as exc:  # noqa: BLE001 - e.g. a keeper gone: every rank must stop together
        problem = CheckpointError(f"cannot read the checkpoint's metadata: {type(exc).__name__}: {exc}")
    if not all_ok(problem is None):
        raise problem or CheckpointError("another rank could not read the checkpoint's metadata.")
    try:
        with single_process_quiet():
            dcp.load(state, storage_reader=reader)
    except CheckpointException as exc:
        for err, _trace in exc.failures.values():
            if isinstance(err, UserError):
                raise err from None
        raise


@dataclass
class Checkpoint:
    """One checkpoint opened for reading: where it is, its step, verified manifest and folder URL.

    `source` is the tier it came from (memory | peer | storage | replica); `state` is the state
    dict loaded from it when the opener asked for one.
    """

    location: Any
    step: int
    manifest: dict
    url: str
    source: str = "storage"
    state: dict | None = None

    def read(self, name: str) -> bytes:
        """One of its files, checked against the manifest's sha256."""
        return self.location.read(self.step, name, self.manifest)

    def reader(self) -> Any:
        """A DCP StorageReader of its tensors; every chunk is checked against its hash as it is read."""
        return self.location.reader(self.step, self.manifest)

    def metadata(self) -> Metadata:
        """Its DCP `.metadata`: verified, unpickled admitting DCP's classes only, and every tensor it declares
        no larger than the bytes the manifest lists for it (so tensors may be allocated from it)."""
        where = f"{self.url}/{METADATA}"
        metadata = load_metadata(self.read(METADATA), where)
        check_sizes(metadata, self.manifest, where)
        return metadata


def restore(locs: list, name: str, prepare: Callable[[Checkpoint], dict] | None = None,
            step: int | None = None) -> Checkpoint:
    """The first good checkpoint in `restore_order(locs, step)`; on every rank, the same one on all.

    Rank 0 verifies a candidate's files (sha256) and that its chunks are there before any rank
    reads it. With `prepare`, the state dict it builds from the candidate (reading its verified
    files: state, config, `.metadata`) is then loaded from it, in place. A candidate that fails
    either step is refused and the next one tried, so a checkpoint is never half-used. When one
    was refused, rank 0 logs one warning line naming it, why, and what is used instead. `name`
    (the run or the folder) is named in the CheckpointError raised when nothing loads.
    """
    attempts = broadcast(restore_order(locs, step) if rank() == 0 else None)
    refused: list[str] = []
    first: str | None = None
    for s, i in attempts:
        loc = locs[i]
        manifest, problem = None, None
        if rank() == 0:
            try:
                manifest = loc.check(s)
            except (CheckpointError, StorageError) as exc:
                problem = str(exc)
        manifest, problem = broadcast((manifest, problem))
        ckpt = Checkpoint(loc, s, manifest or {}, loc.checkpoint_url(s), loc.label)
        ok = manifest is not None
        if ok and prepare is not None:
            try:
                ckpt.state = prepare(ckpt)
            except (CheckpointError, StorageError) as exc:
                ok, problem = False, str(exc)
            if all_ok(ok):
                try:
                    load_state(ckpt.state, ckpt.reader())
                except (CheckpointException, CheckpointError, StorageError) as exc:
                    ok, problem = False, str(exc).splitlines()[0][:300]
            ok = all_ok(ok)
        if not ok:
            problem = first_problem(problem)
            first = first or problem
            refused.append(f"checkpoint {ckpt.url} refused ({problem.rstrip('.')})")
            continue
        if isinstance(loc, MemoryLocation) and prepare is not None and not all_ok(not loc.tier.peer_used):
            ckpt.source = "peer"  # some rank read a copy held by another node's keeper
        if refused and rank() == 0:
            log.warning("%s; using %s", "; ".join(refused), ckpt.url)
        return ckpt
    if first is None:
        which = "yet" if step is None else f"of step {step}"
        raise CheckpointError(f"'{name}' has no complete checkpoint {which}.")
    raise CheckpointError(f"no loadable checkpoint in '{name}': {first}")

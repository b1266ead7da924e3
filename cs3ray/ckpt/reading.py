"""open_checkpoint: the one way to open a checkpoint for reading (generate, serve, export, fine-tuning).

It finds what the run's trainer would restore from, and in the same order: the memory tier when
the run keeps one and this process is connected to its Ray cluster, the run directory, then the
replicas, newest step first (see restore). The replicas are the URLs the caller names, plus the
`checkpoint.replicas` of the run's stored config only when the caller confirms them
(`--use-stored-replicas`): a stored file names locations, it never makes us contact them.
"""

from __future__ import annotations

import logging
import sys
from typing import Callable, Sequence

import yaml

from cs3ray.config import JobConfig, resolve_run, stored_config
from cs3ray.errors import UserError
from cs3ray.storage import Storage, StorageError, open_url

from .keeper import NAMESPACE, MemoryTier
from .locations import STEP_RE, MemoryLocation, StorageLocation, list_steps, step_dir
from .manifest import MANIFEST, CheckpointError, read_manifest
from .restore import Checkpoint, broadcast, rank, restore

log = logging.getLogger(__name__)


def _run_config(run: Storage) -> JobConfig | None:
    """The config of the run's newest checkpoint that has a readable one, else the run's own config.yaml."""
    loc = StorageLocation(run)
    for s in reversed(list_steps(run)):
        try:
            text = loc.read(s, "config.yaml", read_manifest(loc.folder(s)))
            return stored_config(yaml.safe_load(text), source=f"{loc.folder(s).url}/config.yaml")
        except (UserError, yaml.YAMLError):
            continue  # damaged (restore will refuse it too) or written by another version
    try:
        if run.exists("config.yaml"):
            return stored_config(yaml.safe_load(run.read_text("config.yaml")), source=f"{run.url}/config.yaml")
    except (UserError, yaml.YAMLError):
        pass
    return None


def _keepers_running() -> bool:
    """Whether this process is connected to a Ray cluster where memory-tier keepers run."""
    # A process that never imported Ray (cs3 generate, export) has no cluster to ask.
    if "ray" not in sys.modules:
        return False
    import ray

    if not ray.is_initialized():
        return False
    try:
        return any(a["namespace"] == NAMESPACE for a in ray.util.list_named_actors(all_namespaces=True))
    except Exception:  # noqa: BLE001 - a cluster that cannot answer has no memory tier for us
        return False


def _target(run_or_url: str, options: dict | None, step: int | None, stored_replicas: bool) -> dict:
    """What to open: the run's URL, the step when one is named, the stored replicas (all of them, and those to
    use: only when confirmed) and whether to ask memory."""
    storage = open_url(resolve_run(run_or_url), options)
    try:
        explicit = storage.exists(MANIFEST)
        if not explicit and not storage.exists():
            raise CheckpointError(f"run or checkpoint '{run_or_url}' does not exist (looked at '{storage.url}').")
        run = storage
        if explicit:  # one checkpoint folder: that step of the run it belongs to
            run = open_url(storage.url.rstrip("/").rsplit("/", 1)[0], options)
            named = int(read_manifest(storage)["step"])
            m = STEP_RE.match(storage.url.rstrip("/").rsplit("/", 1)[-1])
            if not m or int(m.group(1)) != named:
                raise CheckpointError(f"'{storage.url}' is not named {step_dir(named)} as its manifest says.")
            if step is not None and step != named:
                raise CheckpointError(f"'{storage.url}' holds step {named}, not step {step}.")
            step = named
        cfg = _run_config(run)
    except StorageError as exc:
        raise CheckpointError(str(exc)) from None
    return {"run": run.url, "step": step, "folder": storage.url if explicit else None,
            "stored": list(cfg.checkpoint.replicas) if cfg else [],
            "replicas": list(cfg.checkpoint.replicas) if cfg and stored_replicas else [],
            "memory": bool(cfg and cfg.checkpoint.memory_tier and _keepers_running())}


def open_checkpoint(run_or_url: str, storage_options: dict | None = None, step: int | None = None,
                    prepare: Callable[[Checkpoint], dict] | None = None, replicas: Sequence[str] = (),
                    stored_replicas: bool = False) -> Checkpoint:
    """Open the newest good checkpoint of a run (a name means runs/<name>, or a path or URL).

    Verified and with the fallback of the trainer's restore: memory (when the run keeps one and
    its keepers are reachable) -> the run directory -> `replicas` (URLs the caller names), then
    those of the run's stored config when `stored_replicas` confirms them -> the previous
    step, with one warning line naming a refused checkpoint and why. A checkpoint folder, or
    `step`, opens that step only (its copies in memory and replicas still count), and a damaged
    one is a CheckpointError. `prepare(ckpt)` builds the state dict to load from a candidate (from
    its verified files); it is loaded before the candidate counts as good (`Checkpoint.state`), so
    a chunk that fails its hash falls back too. Call it on every rank when torch.distributed is on.
    """
    target: dict | str | None = None
    if rank() == 0:
        try:
            target = _target(run_or_url, storage_options, step, stored_replicas)
        except CheckpointError as exc:
            target = str(exc)
    target = broadcast(target)  # every rank opens the same locations
    if isinstance(target, str):
        raise CheckpointError(target)
    run = open_url(target["run"], storage_options)
    locs: list = []
    if target["memory"]:
        locs.append(MemoryLocation(MemoryTier(run.url)))
    locs.append(StorageLocation(run))
    urls = list(dict.fromkeys([*replicas, *target["replicas"]]))
    locs += [StorageLocation(open_url(u, storage_options), "replica") for u in urls]
    try:
        return restore(locs, target["folder"] or run.url, prepare, target["step"])
    except CheckpointError as exc:
        unused = [u for u in target["stored"] if u not in urls]
        if not unused:
            raise
        raise CheckpointError(f"{str(exc).rstrip('.')}; the run's stored config lists {len(unused)} replica(s), not "
                              "contacted unless you confirm them with --use-stored-replicas or name them with "
                              "--ckpt-replica URL.") from None

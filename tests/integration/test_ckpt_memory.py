"""Memory tier on the real Ray cluster: restore from the keepers when storage is damaged, and back."""

import shutil

import torch

from cs3ray.ckpt import CheckpointManager, load_for_inference, open_checkpoint
from cs3ray.ckpt.keeper import NAMESPACE, MemoryTier, alive_nodes
from cs3ray.config import load_config, to_yaml
from cs3ray.models import ByteTokenizer, Transformer

ARGS = ["model.dim=32", "model.n_layers=2", "model.n_heads=4", "model.ffn_dim=64", "model.max_seq_len=32",
        "train.seq_len=16"]


def _model(seed):
    torch.manual_seed(seed)
    return Transformer(load_config(None, ARGS).model.args())


def _save(mgr, model, step):
    files = {"config.yaml": to_yaml(load_config(None, ARGS)), "tokenizer.json": ByteTokenizer().to_json()}
    mgr.save(step, {"model": model.state_dict()}, {"step": step}, {"torch": torch.get_rng_state()}, files)


def _load(mgr):
    fresh = _model(99)
    state = {"model": fresh.state_dict()}
    step, _, rank_state = mgr.load(state)
    fresh.load_state_dict(state["model"])
    same = all(torch.equal(a, b)
               for a, b in zip(fresh.state_dict().values(), MODEL.state_dict().values(), strict=True))
    return step, same, rank_state


MODEL = _model(1)


def test_restore_from_memory_when_storage_chunks_are_gone(ray_client, tmp_path):
    ray = ray_client
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, memory_tier=True, async_mode="async")
    _save(mgr, _model(0), 1)
    _save(mgr, MODEL, 2)
    mgr.close()
    assert sorted(MemoryTier(mgr.run.url).steps()) == [2]  # only the newest snapshot stays in memory

    restarted = CheckpointManager(run, memory_tier=True)  # a new group after a failure
    step, same, rank_state = _load(restarted)
    assert (step, same, restarted.last_restore.source) == (2, True, "memory") and "torch" in rank_state

    shutil.rmtree(tmp_path / "run" / "chunks")  # storage lost its tensor data: memory still restores
    step, same, _ = _load(CheckpointManager(run, memory_tier=True))
    assert (step, same) == (2, True)
    # A reader connected to the cluster (a serve replica) opens it as the trainer's restore does: from memory.
    ckpt = open_checkpoint(run, prepare=lambda c: {"model": _model(99).state_dict()})
    assert (ckpt.step, ckpt.source) == (2, "memory")
    assert all(torch.equal(a, b) for a, b in zip(load_for_inference(run).model.state_dict().values(),
                                                  MODEL.state_dict().values(), strict=True))

    _save(restarted, MODEL, 3)  # rewrites every chunk (first save of this manager), storage whole again
    for node in alive_nodes():  # every keeper gone (a lost node): restore falls back to storage
        ray.kill(ray.get_actor(f"keeper-{node}", namespace=NAMESPACE))
    again = CheckpointManager(run, memory_tier=True)
    step, same, _ = _load(again)
    assert (step, same, again.last_restore.source) == (3, True, "storage")


def test_a_corrupt_chunk_in_memory_is_detected_and_the_restore_falls_back_to_storage(ray_client, tmp_path, caplog):
    import numpy as np

    from cs3ray.ckpt.chunks import ChunkStore
    from cs3ray.ckpt.keeper import keeper

    ray = ray_client
    run = str(tmp_path / "run")
    mgr = CheckpointManager(run, memory_tier=True)
    _save(mgr, MODEL, 1)
    mgr.close()
    tier = MemoryTier(mgr.run.url)
    manifest = tier.steps()[1]
    files = ray.get(keeper(alive_nodes()[0]).files.remote(mgr.run.url, 1))
    blobs = {h: np.frombuffer(ChunkStore(mgr.run).get(h), dtype=np.uint8) for h in manifest["chunks"]}
    damaged = max(blobs, key=lambda h: blobs[h].nbytes)
    blobs[damaged] = blobs[damaged].copy()
    blobs[damaged][7] ^= 0x10  # one flipped bit, same size: what a size check cannot see
    for node in alive_nodes():  # the keepers now hold the snapshot with that chunk damaged
        ray.get(keeper(node).drop.remote(mgr.run.url))
    tier.push(1, blobs, files)
    tier.commit(1, manifest, {})
    assert sorted(MemoryTier(mgr.run.url).steps()) == [1]

    again = CheckpointManager(run, memory_tier=True)  # what a restarted worker group does
    with caplog.at_level("WARNING", logger="cs3ray.ckpt"):
        step, same, _ = _load(again)
    assert (step, same, again.last_restore.source) == (1, True, "storage")
    assert f"chunk {damaged[:12]}" in caplog.text and "checksum" in caplog.text

"""`cs3 bench ckpt`: checkpoint overhead (sync vs async), incremental size, memory vs S3 restore.

Training steps run in this process through the compute core (no Ray), as the workers run
them; only part 3 starts an embedded Ray, because the memory tier lives in keeper actors.
Both restores do the same work apart from where the bytes come from: every chunk is checked
against its XXH3 hash, from memory as from storage.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np
import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.ckpt.finetune import load_init_weights
from cs3ray.config import load_config, to_yaml
from cs3ray.core.freeze import apply_freeze
from cs3ray.models import ByteTokenizer

from . import stats

# The seeds snapshot every 15 minutes and allow it 2% of their training time.
SEEDS_INTERVAL_S = 15 * 60
# The targets: async overhead <= 0.2x sync's, the fine-tune's 2nd checkpoint <= 1.1x the changed
# fraction, a memory restore <= 0.5x a storage restore; at the seeds' interval, either mode <= 2%.
TARGETS = {"async_over_sync_overhead": {"at_most": 0.2}, "incremental_over_changed": {"at_most": 1.1},
           "restore_memory_over_storage": {"at_most": 0.5}, "overhead_at_15_min_pct": {"at_most": 2.0},
           "sync_overhead_at_15_min_pct": {"at_most": 2.0}}
PAIRED = ["sync_overhead_pct", "async_overhead_pct", *TARGETS]
JSON_KEYS = ["interval_steps", "rounds", *(f"{k}{part}" for k in PAIRED for part in ("", "_interval", "_rounds")),
             "incremental_size_ratio", "changed_fraction", "save_s", "restore_memory_s", "restore_storage_s",
             "restore_rounds", "async_blocking_s", "targets", "verdicts", "method"]
ROUNDS_METHOD = ("rounds: (1) none-sync-async checkpoint intervals in turn, each round's against the none intervals "
                 "on either side (overheads in %: t on the raw values, as is their ratio, which may be negative); "
                 "(3) memory and storage restores back to back, the order reversed every other round; (2) is "
                 "counted, its interval the point; at 15 minutes: each round's save() blocking seconds / 900 s; "
                 f"{stats.METHOD}")
QUICK = ["model.preset=tiny", "train.batch_size=4", "train.seq_len=64"]


class _Trainer:
    """One rank's compute core fed random token batches, with the loop's checkpoint calls."""

    def __init__(self, cfg, freeze: list[str] | None = None, init_from: str | None = None) -> None:
        import cs3ray.core.engine as engine
        from cs3ray.core.mesh import Topology

        self.cfg = cfg
        if freeze:
            # The compute core builds its model inside; freeze it between construction and the optimizer.
            real = engine.model_from_config
            engine.model_from_config = lambda c: _frozen(real(c), freeze)
        try:
            self.core = engine.ComputeCore(cfg, torch.device("cpu"), Topology(0, 1, 1, ("n0",)))
        finally:
            if freeze:
                engine.model_from_config = real
        if init_from:
            load_init_weights(self.core.model, init_from)
        self.rng = np.random.default_rng(0)
        self.step_no = 0

    def step(self) -> None:
        t = self.cfg.train
        batch = self.rng.integers(0, 256, (t.batch_size, t.seq_len + 1)).astype(np.int64)
        self.core.step(lambda: batch, t.lr)
        self.step_no += 1

    def save(self, mgr: CheckpointManager) -> None:
        files = {"config.yaml": to_yaml(self.cfg), "tokenizer.json": ByteTokenizer().to_json()}
        mgr.save(self.step_no, self.core.state(), {"step": self.step_no}, {"torch": torch.get_rng_state()}, files)


def _frozen(model, patterns):
    apply_freeze(model, patterns)
    return model


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _state_bytes(state: dict) -> dict[str, torch.Tensor]:
    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(node, torch.Tensor):
            flat[prefix] = node.detach().clone()
    walk("", state)
    return flat


def run(config: str = "configs/small.yaml", quick: bool = False, log: Callable[[str], None] | None = None) -> dict:
    """All three parts; returns the issue's JSON keys plus detail."""
    say = log or (lambda m: None)
    cfg = load_config(config, (QUICK if quick else []) + ["precision=fp32"])
    torch.set_num_threads(max(1, torch.get_num_threads()))
    work = tempfile.mkdtemp(prefix="cs3-bench-ckpt-")
    out: dict[str, Any] = {"config": config}
    try:
        # (1) Step time with no checkpoints vs a checkpoint every K steps, sync and async. One
        # interval is K steps, after a save (sync, async) or not (none); an async interval ends
        # by waiting for its write, so it carries the save's whole cost. The modes take turns,
        # none-sync-async, round after round, with a last none: each round's sync and async
        # intervals are compared with the mean of the none intervals on either side, and the
        # median over rounds is reported, so load from other work on a shared machine (it comes
        # and goes within minutes) is the same for the intervals compared.
        tr = _Trainer(cfg)
        tr.step()  # warm-up
        step_s = min(_timed(tr.step) for _ in range(3))
        managers = {"sync": CheckpointManager(f"{work}/sync", keep=2),
                    "async": CheckpointManager(f"{work}/async", keep=2, async_mode="async")}
        save_s = float("inf")
        for _ in range(2):  # a step in between, so every trainable chunk changes as in training
            tr.step()
            save_s = min(save_s, _timed(lambda: tr.save(managers["sync"])))
        tr.save(managers["async"])  # warm-up, as a run's first save: the staging buffers exist from here on
        managers["async"].wait()
        k = max(1, int(save_s / (0.25 * step_s)))  # sync then costs >= 20% of step time (about 25%)
        say(f"step {step_s:.3f}s, sync save {save_s:.3f}s -> checkpoint every {k} steps")
        rounds = 2 if quick else 5
        times: dict[str, list[float]] = {"none": [], "sync": [], "async": []}
        # What each save() call blocked training for, per mode (sync: the whole save; async: the copy).
        blocking: dict[str, list[float]] = {"sync": [], "async": []}

        def interval(mgr: CheckpointManager | None) -> float:
            t0 = time.perf_counter()
            if mgr is not None:
                blocking["sync" if mgr.async_mode == "disabled" else "async"].append(_timed(lambda: tr.save(mgr)))
            for _ in range(k):
                tr.step()
            if mgr is not None:
                mgr.wait()  # the async write must be finished inside the timed window
            return time.perf_counter() - t0

        for r in range(rounds + 1):
            times["none"].append(interval(None))
            if r == rounds:
                break
            for mode in ("sync", "async"):
                times[mode].append(interval(managers[mode]))
            say("  ".join(f"{m}: {t[-1] / k:.3f}s/step" for m, t in times.items()))
        for mgr in managers.values():
            mgr.close()
        none = times["none"]
        overhead = {m: [100 * (t / ((none[i] + none[i + 1]) / 2) - 1) for i, t in enumerate(ts)]
                    for m, ts in times.items() if m != "none"}
        out.update(interval_steps=k, step_s=step_s, save_s=save_s, rounds=rounds,
                   **stats.summarize("sync_overhead_pct", overhead["sync"], difference=True),
                   **stats.summarize("async_overhead_pct", overhead["async"], difference=True),
                   **stats.summarize("async_over_sync_overhead", [a / s if s else math.inf for a, s in
                                                                  zip(overhead["async"], overhead["sync"], strict=True)],
                                     difference=True),
                   async_blocking_s=float(np.median(blocking["async"])),
                   **_at_seeds_interval(blocking),
                   interval_s={m: [round(t, 3) for t in ts] for m, ts in times.items()})

        # (2) fine-tune with embeddings and all blocks but the last frozen: second checkpoint's new bytes.
        pre = CheckpointManager(f"{work}/pre", keep=1)
        tr.save(pre)
        layers = cfg.model.args().n_layers
        freeze = ["tok_emb.*"] + ([f"blocks.[0-{layers - 2}].*"] if layers > 1 else [])
        ft = _Trainer(cfg, freeze=freeze, init_from=f"{work}/pre")
        mgr = CheckpointManager(f"{work}/ft", keep=2)
        ft.step()
        ft.save(mgr)
        first = _state_bytes(ft.core.state())
        ft.step()
        ft.save(mgr)
        second = _state_bytes(ft.core.state())
        total = sum(t.numel() * t.element_size() for t in second.values())
        changed = sum(t.numel() * t.element_size() for k2, t in second.items() if not torch.equal(t, first[k2]))
        out.update(changed_fraction=changed / total,
                   incremental_size_ratio=mgr.last_save["bytes_written"] / mgr.last_save["bytes_total"],
                   full_checkpoint_bytes=mgr.last_save["bytes_total"], incremental_bytes=mgr.last_save["bytes_written"])
        # Bytes counted, not timed: the same on every run.
        out.update(stats.exact("incremental_over_changed", out["incremental_size_ratio"] / max(out["changed_fraction"], 1e-12)))
        say(f"fine-tune: wrote {out['incremental_size_ratio']:.4f} of a full checkpoint, "
            f"changed {out['changed_fraction']:.4f}")

        # (3) restore: memory tier (keeper actors) vs the loopback S3 endpoint.
        out.update(_restore(tr, say, 2 if quick else 3))
        out.update(targets=TARGETS, verdicts=stats.judge(out, TARGETS), method=ROUNDS_METHOD)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def _at_seeds_interval(blocking: dict[str, list[float]]) -> dict[str, Any]:
    """Each mode's overhead at the seeds' 15-minute interval, in %: a round's blocking seconds / 900 s.

    Extrapolated, not run for 15 minutes: only what blocks training counts, so an async write's share
    of the CPU in the background (in async_overhead_pct at the measured interval) is left out.
    """
    pct = {mode: [100 * b / SEEDS_INTERVAL_S for b in times] for mode, times in blocking.items()}
    return {**stats.summarize("overhead_at_15_min_pct", pct["async"], difference=True),
            **stats.summarize("sync_overhead_at_15_min_pct", pct["sync"], difference=True)}


def _restore(tr: _Trainer, say, rounds: int) -> dict[str, Any]:
    """Memory and storage restores back to back for `rounds` rounds (the order reversed every other round);
    their ratio per round, and each tier's median time."""
    import ray

    from cs3ray.bench.loopback_s3 import MotoServer, make_bucket, s3_options

    moto = MotoServer()
    started = False
    try:
        make_bucket(moto.url, "cs3")
        options = s3_options(moto.url)
        if not ray.is_initialized():
            ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False)
            started = True
        url = f"s3://cs3/bench-{int(time.time())}"
        mgr = CheckpointManager(url, options, memory_tier=True)
        tr.save(mgr)
        state = tr.core.state()
        times: dict[str, list[float]] = {"memory": [], "storage": []}
        for r in range(rounds):
            for tier in (("memory", "storage") if r % 2 == 0 else ("storage", "memory")):
                loader = CheckpointManager(url, options, memory_tier=tier == "memory")
                times[tier].append(_timed(lambda loader=loader: loader.load(state)))
                if loader.last_restore.source != tier:  # a timing of another tier's restore
                    raise RuntimeError(f"the restore meant to come from {tier} came from "
                                       f"{loader.last_restore.source}")
            say(f"restore round {r + 1}: memory {times['memory'][-1]:.3f}s, S3 {times['storage'][-1]:.3f}s")
        return {"restore_memory_s": float(np.median(times["memory"])),
                "restore_storage_s": float(np.median(times["storage"])),
                "restore_rounds": {tier: [round(t, 4) for t in ts] for tier, ts in times.items()},
                **stats.summarize("restore_memory_over_storage",
                                  [m / s for m, s in zip(times["memory"], times["storage"], strict=True)])}
    finally:
        if started:
            ray.shutdown()
        moto.stop()


def title(r: dict) -> str:
    return (f"checkpoints ({r['config']}; medians of {r['rounds']} rounds [95% interval]; at 15 minutes: blocking "
            f"s / 900 s: {stats.verdict_line(r, 3)})")  # 3 digits: the 15-minute overheads are hundredths of a %


def rows(r: dict) -> list[tuple]:
    """Table rows: medians of the rounds, the paired figures as `median [95% interval]`."""
    return [("checkpoint every K steps", "K", r["interval_steps"]),
            ("sync overhead", "% of step time", stats.shown(r, "sync_overhead_pct", 1)),
            ("async overhead", "% of step time", stats.shown(r, "async_overhead_pct", 1)),
            ("async / sync overhead (<= 0.2)", "ratio", stats.shown(r, "async_over_sync_overhead")),
            ("fine-tune 2nd checkpoint", "bytes / full", r["incremental_size_ratio"]),
            ("2nd checkpoint / changed (<= 1.1)", "ratio", stats.shown(r, "incremental_over_changed", 3)),
            ("state really changed", "fraction", r["changed_fraction"]),
            ("sync save", "s", r["save_s"]),
            ("async save blocks training", "s", r["async_blocking_s"]),
            ("async overhead at a 15-min interval (<= 2)", "% of time", stats.shown(r, "overhead_at_15_min_pct", 3)),
            ("sync overhead at a 15-min interval (<= 2)", "% of time", stats.shown(r, "sync_overhead_at_15_min_pct", 3)),
            ("restore from memory", "s", r["restore_memory_s"]),
            ("restore from S3 (moto)", "s", r["restore_storage_s"]),
            ("memory / S3 restore (<= 0.5)", "ratio", stats.shown(r, "restore_memory_over_storage", 3))]

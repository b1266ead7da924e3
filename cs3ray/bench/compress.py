"""`cs3 bench compress`: convergence, bytes and overlap of each gradient codec against torch's peers.

Per seed, every codec trains the same model from the same initial weights on the same batches
(the seed's order) for the same steps, 2 ranks of the real ComputeCore in plain
torch.distributed processes (gloo, no Ray: what is compared is the gradient sync, not the
cluster). DDP: none (torch's `allreduce_hook`), int8 and int4_sparse (cs3ray's `compress_hook`),
and torch's `bf16_compress_hook`, `quantization_pertensor_hook` (its algorithm with gloo's
all-gather results read as gloo nests them; first seed only) and PowerSGD at the rank whose bytes
match int4_sparse's. FSDP2: none, int8 and int4_sparse (the compressed reduce-scatter), and
FSDP2's own `reduce_dtype=bf16` as their peer.

Convergence is judged on held-out loss: per seed, the codec's delta against that seed's none in
%, paired; over seeds its median and 95% t interval, and non-inferiority within MARGIN_PCT
(`no worse` when the interval's upper bound is within it, `worse` when its lower bound is past
it, else `inconclusive`, which gets more seeds while the run stays within BUDGET_S). The
near-lossless bf16 peers' own paired delta is the noise floor.

wire_ratio is bytes sent / an fp32 ring all-reduce of the same gradient (FSDP: a ring
reduce-scatter). cs3ray counts its bytes as it sends them; torch's hooks are counted from what
they send: bf16 half of fp32; quantization_pertensor all-gathers one uint8 per value plus its
scale and zero point from every rank ((n-1) x (numel + 8) bytes sent); PowerSGD all-reduces
its P and Q matrices and, uncompressed, the tensors it does not compress (its own
numel-after / numel-before count). overlap_fraction is measured after training: the median
step with sync, the same step without gradient communication (compute alone: DDP's `no_sync`;
FSDP2's reduce-scatter replaced by a copy of the rank's own chunk) and a replay of one step's
buckets (DDP) or reduce-scatter inputs (FSDP2) through the same sync (communication alone);
hidden = (compute + comm - step) / comm, clipped to [0, 1].
"""

import dataclasses
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook, quantization_hooks

from cs3ray.bench import stats
from cs3ray.config import load_config
from cs3ray.core.compress import CompressionHook, compress_hook, make_codec
from cs3ray.core.engine import ComputeCore
from cs3ray.core.mesh import Topology
from cs3ray.core.optim import lr_factor
from cs3ray.core.parallel import dgc_settings
from cs3ray.core.precision import resolve_precision
from cs3ray.data.shards import read_split
from cs3ray.ops.ports import free_port
from cs3ray.train.driver import prepare_data

CONFIG = "configs/tiny.yaml"
WORLD = 2
STEPS, QUICK_STEPS = 180, 4
SEEDS, QUICK_SEEDS = 3, 2
MAX_SEEDS = 6  # inconclusive verdicts get more seeds while the run stays within BUDGET_S
BUDGET_S = 540.0
TIMED_ROUNDS, QUICK_TIMED_ROUNDS = 8, 2  # overlap timing: the first seed only
LAST = 10  # final_loss: mean of the last steps' loss (less noise than one step)
HELDOUT, QUICK_HELDOUT = 16, 2  # validation batches per rank for heldout_loss, the same for every codec
SHAPE = ("train.batch_size=4", "train.seq_len=64")  # rows of tiny.yaml's model per rank and step
# --quick: a quarter of the tokens a step (the same model, so the same gradients' bytes) and a smaller corpus: CPUs
# without fp16 matmul hardware run precision=fp16 ~25x slower than fp32, and the smoke run reads a few hundred rows.
QUICK_SHAPE = ("train.batch_size=2", "train.seq_len=32", "data.max_bytes=1000000")
MARGIN_PCT = 2.0  # non-inferiority margin on the held-out loss delta against none
POWERSGD = "torch_powersgd"  # at the rank whose bytes match int4_sparse's
DDP_CODECS = ("none", "int8", "int4_sparse", "torch_bf16_hook", "torch_quant_pertensor_hook", POWERSGD)
FSDP_CODECS = ("none", "int8", "int4_sparse", "torch_fsdp_reduce_bf16")
FIRST_SEED_ONLY = ("torch_quant_pertensor_hook",)  # a peer of int8 at equal bytes, shown but not judged
OURS = ("int8", "int4_sparse")
# The targets: each codec no worse than none (within MARGIN_PCT) at these fp32 fractions of bytes.
WIRE_TARGETS = {"int8": 0.26, "int4_sparse": 1 / 16}
NOISE_PEERS = {"ddp": "torch_bf16_hook", "fsdp": "torch_fsdp_reduce_bf16"}  # near-lossless: their delta is noise
COLUMNS = ["strategy", "codec", "seeds", "held-out loss", "held-out delta % [95%]", "verdict", "final loss delta %",
           "wire ratio", "overlap", "state MB/worker"]


class _Recorder:
    """A DDP comm hook's state wrapped so the buckets of a step can be replayed (communication alone)."""

    def __init__(self, state: Any, hook: Callable) -> None:
        self.state, self.hook = state, hook
        self.recording = False
        self.buckets: list[dist.GradBucket] = []
        self.calls = 0  # buckets synced, replays excluded


# No postponed annotations in this module: DDP checks a hook's annotations against the real types.
def _recording_hook(rec: _Recorder, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Run the wrapped hook, keeping the bucket while recording."""
    if rec.recording:
        rec.buckets.append(bucket)
    rec.calls += 1
    return rec.hook(rec.state, bucket)


def _gathered(fut: torch.futures.Future) -> list[torch.Tensor]:
    """An all_gather future's tensors: NCCL nests them in one more list than gloo does."""
    value = fut.value()
    return value[0] if isinstance(value[0], list) else value


def _pertensor_hook(process_group: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `quantization_pertensor_hook` as torch writes it (observer, quantize and dequantize
    functions, two all-gathers chained by callbacks), reading the gathered values as gloo returns them:
    torch's own indexes them as NCCL nests them and fails on gloo with an IndexError."""
    group = process_group if process_group is not None else dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    tensor = bucket.buffer()
    observer = torch.ao.quantization.MinMaxObserver()
    observer(tensor)
    scale, zero = observer.calculate_qparams()
    s_and_z = torch.tensor([float(scale), float(zero)])
    fut = dist.all_gather([torch.zeros_like(s_and_z) for _ in range(world)], s_and_z, group=group,
                          async_op=True).get_future()
    params: list[list[torch.Tensor]] = []

    def quantize_and_gather(fut: torch.futures.Future) -> list[torch.Tensor]:
        params.append(_gathered(fut))
        q = quantization_hooks._quantize_per_tensor_backend(tensor, params[0][rank][0], params[0][rank][1])
        return dist.all_gather([torch.zeros_like(q) for _ in range(world)], q, group=group,
                               async_op=True).get_future().wait()

    def dequantize_and_mean(fut: torch.futures.Future) -> torch.Tensor:
        total = torch.zeros_like(tensor, dtype=torch.float32)
        for r, q in enumerate(_gathered(fut)):
            total += quantization_hooks._dequantize_per_tensor_backend(q, params[0][r][0], params[0][r][1])
        return total / world
    return fut.then(quantize_and_gather).then(dequantize_and_mean)


def _install_ddp_hook(core: ComputeCore, codec: str, cfg: Any) -> tuple[_Recorder, Callable[[int], float | None]]:
    """Register the codec's hook on the core's DDP model; returns it and a wire_ratio reader (by steps synced)."""
    model = core.model
    if codec in OURS:
        c = cfg.compression
        # What parallel.apply_compression registers, but wrapped by the recorder.
        state = CompressionHook(codec, c.density, c.error_feedback, c.warmup_steps, ddp_buckets=True,
                                dgc=dgc_settings(c.model_copy(update={"codec": codec}), cfg.train.clip))
        state.names = {id(p): name for name, p in model.named_parameters()}
        state.set_transactional(core.scaler.enabled)  # as the engine's own hook: fp16 steps may be skipped
        core.compression = state  # so memory() counts its residuals and comm_stats() its bytes
        rec = _Recorder(state, compress_hook)
        model.register_comm_hook(rec, _recording_hook)
        return rec, lambda _steps: state.stats()["wire_ratio"]
    n = sum(p.numel() for p in core.params)
    ring = 2 * (WORLD - 1) / WORLD * 4 * n
    if codec == "none":
        rec = _Recorder(None, default_hooks.allreduce_hook)
        model.register_comm_hook(rec, _recording_hook)
        return rec, lambda _steps: 1.0
    if codec == "torch_bf16_hook":
        rec = _Recorder(None, default_hooks.bf16_compress_hook)
        model.register_comm_hook(rec, _recording_hook)
        return rec, lambda _steps: 0.5  # a ring all-reduce of 2-byte values
    if codec == "torch_quant_pertensor_hook":
        rec = _Recorder(None, _pertensor_hook)
        model.register_comm_hook(rec, _recording_hook)
        # Per bucket: all_gather of its (scale, zero point) pair (8 bytes), then of one uint8 per value.
        return rec, lambda steps: (WORLD - 1) * (n * steps + 8 * rec.calls) / (ring * steps)
    if codec == POWERSGD:
        rank = powersgd_rank([p.shape for p in core.params], sparse_wire_ratio(cfg.compression.density))
        # start_powerSGD_iter=2 is the earliest torch allows with error feedback; step 1 syncs in fp32.
        state = powerSGD_hook.PowerSGDState(None, matrix_approximation_rank=rank, start_powerSGD_iter=2,
                                            use_error_feedback=True, warm_start=True, random_seed=0)
        rec = _Recorder(state, powerSGD_hook.powerSGD_hook)
        model.register_comm_hook(rec, _recording_hook)

        def powersgd_ratio(steps: int) -> float:
            # Its counters cover the compressed steps; the first step's fp32 sync is averaged in.
            compressed = state.total_numel_after_compression / max(1, state.total_numel_before_compression)
            return ((steps - 1) * compressed + 1.0) / steps if steps else compressed
        return rec, powersgd_ratio
    raise ValueError(f"unknown ddp codec {codec!r}")


def sparse_wire_ratio(density: float, values: int = 1 << 20) -> float:
    """int4_sparse's bytes per fp32 byte on a large chunk (its steady state, after any warm-up)."""
    return make_codec("int4_sparse", density).wire_bytes(values) / (4 * values)


def powersgd_ratio_at(shapes: list[torch.Size], rank: int) -> float:
    """PowerSGD's numel after / before compression at `rank`, as its hook counts: a matrix whose P and Q
    would not be smaller than itself, and every vector, is all-reduced uncompressed."""
    before = after = 0
    for shape in shapes:
        numel = math.prod(shape)
        before += numel
        if len(shape) < 2:
            after += numel
            continue
        n, m = shape[0], numel // shape[0]
        after += min(numel, (n + m) * rank)
    return after / max(1, before)


def powersgd_rank(shapes: list[torch.Size], target: float, most: int = 64) -> int:
    """The PowerSGD rank whose bytes come closest to `target` (a fraction of fp32)."""
    return min(range(1, most + 1), key=lambda r: abs(powersgd_ratio_at(shapes, r) - target))


class _FsdpSync:
    """What the wrapped reduce-scatters of one FSDP2 model do: sync, record their inputs, or skip the exchange."""

    def __init__(self) -> None:
        self.mode = "sync"  # "record" also keeps each call's input; "skip" moves no bytes
        self.calls: list[tuple[Any, torch.Tensor, torch.Tensor, Any, Any]] = []


class _FsdpReduceScatter:
    """One FSDP module's reduce-scatter (FSDP2's default or cs3ray's compressed one), wrapped for `_FsdpSync`."""

    def __init__(self, inner: Any, sync: _FsdpSync) -> None:
        self.inner, self.sync = inner, sync

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The wrapped reduce-scatter's buffer."""
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        """Reduce-scatter as the wrapped one does, or (skip) copy this rank's own chunk in its place."""
        if self.sync.mode == "skip":
            output_tensor.copy_(input_tensor.view(group.size(), -1)[group.rank()])
            return None
        if self.sync.mode == "record":
            self.sync.calls.append((self.inner, output_tensor.clone(), input_tensor.clone(), group, op))
        return self.inner(output_tensor=output_tensor, input_tensor=input_tensor, group=group, op=op,
                          async_op=async_op)


def _wrap_fsdp_reduce_scatter(model: torch.nn.Module) -> _FsdpSync:
    """Wrap every FSDP module's current reduce-scatter (after training: the runs keep their own sync)."""
    sync = _FsdpSync()
    for module in model.modules():
        if hasattr(module, "set_custom_reduce_scatter"):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                module.set_custom_reduce_scatter(_FsdpReduceScatter(group._reduce_scatter_comm, sync))
    return sync


def _hook_state_bytes(rec: _Recorder) -> int:
    """Bytes a torch hook keeps between steps (PowerSGD: its error feedback and warm-start P and Q)."""
    state = rec.state
    if isinstance(state, powerSGD_hook.PowerSGDState):
        tensors = [*state.error_dict.values(), *state.p_memory_dict.values(), *state.q_memory_dict.values()]
        return sum(t.numel() * t.element_size() for t in tensors)
    return 0


def _fsdp_reduce_in_bf16(model: torch.nn.Module) -> None:
    """The FSDP2 peer: reduce-scatter gradients in bf16 (MixedPrecisionPolicy.reduce_dtype).

    ComputeCore builds FSDP2 with reduce_dtype=fp32; FSDP2 reads each group's policy at its
    lazy init (first forward), so the policy is swapped before that.
    """
    for module in model.modules():
        if hasattr(module, "_get_fsdp_state"):
            group = module._get_fsdp_state()._fsdp_param_group
            if group is not None:
                group.mp_policy = dataclasses.replace(group.mp_policy, reduce_dtype=torch.bfloat16)


def _mean_over_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t) / WORLD


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds `fn` takes on the slower rank (both start together)."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = time.perf_counter() - t0
    t = torch.tensor([dt], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _hidden(step_s: list[float], compute_s: list[float], comm_s: list[float]) -> dict[str, float | None]:
    """The share of communication hidden under compute, from the medians of the timed rounds."""
    step, compute, comm = (statistics.median(x) for x in (step_s, compute_s, comm_s))
    hidden = min(1.0, max(0.0, (compute + comm - step) / comm)) if comm > 0 else None
    return {"overlap_fraction": hidden, "step_s": step, "compute_s": compute, "comm_s": comm}


def _overlap(core: ComputeCore, rec: _Recorder, batch: Callable[[], np.ndarray], lr: float,
             rounds: int) -> dict[str, float | None]:
    """DDP: median step with sync, compute alone (no_sync) and the step's buckets replayed (comm alone)."""
    step_s, compute_s, comm_s = [], [], []

    def replay() -> None:
        futures = [rec.hook(rec.state, b) for b in rec.buckets]
        for f in futures:
            f.wait()
    for _ in range(rounds):
        rec.buckets, rec.recording = [], True
        step_s.append(_timed(lambda: core.step(batch, lr)))
        rec.recording = False
        comm_s.append(_timed(replay))
        with core.model.no_sync():
            compute_s.append(_timed(lambda: core.step(batch, lr)))
    return _hidden(step_s, compute_s, comm_s)


def _fsdp_overlap(core: ComputeCore, batch: Callable[[], np.ndarray], lr: float, rounds: int) -> dict[str, float | None]:
    """FSDP2: median step with sync, the step with each reduce-scatter skipped (compute alone) and one
    step's reduce-scatter inputs replayed through the same reduce-scatters (comm alone)."""
    sync = _wrap_fsdp_reduce_scatter(core.model)
    sync.mode = "record"  # an untimed step: cloning the inputs would weigh on a timed one
    core.step(batch, lr)
    sync.mode = "sync"
    step_s, compute_s, comm_s = [], [], []
    for _ in range(rounds):
        step_s.append(_timed(lambda: core.step(batch, lr)))
        calls = [(inner, out, inp.clone(), group, op) for inner, out, inp, group, op in sync.calls]

        def replay(calls: list = calls) -> None:
            for inner, out, inp, group, op in calls:
                inner(output_tensor=out, input_tensor=inp, group=group, op=op)
        comm_s.append(_timed(replay))
        sync.mode = "skip"
        compute_s.append(_timed(lambda: core.step(batch, lr)))
        sync.mode = "sync"
    return _hidden(step_s, compute_s, comm_s)


def _heldout_loss(core: ComputeCore, rank: int, val: np.ndarray, per: int, count: int) -> float:
    """Mean token loss over `count` validation batches per rank (the same rows for every codec), over both ranks."""
    rows = [val[(i * WORLD * per + rank * per) % (len(val) - per):][:per] for i in range(count)]
    total, tokens = core.evaluate(rows)
    t = torch.tensor([total, tokens], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t[0] / t[1])


def _train(rank: int, job: "Job", batches: np.ndarray, overrides: list[str], steps: int, val: np.ndarray,
           heldout: int) -> dict[str, Any]:
    """Train one (seed, strategy, codec) on this rank; losses are the ranks' mean."""
    strategy, codec = job.strategy, job.codec
    ours = codec in OURS
    cfg = load_config(CONFIG, overrides + [f"cluster.workers={WORLD}", f"parallel.strategy={strategy}",
                                           f"train.seed={job.seed}",
                                           f"compression.codec={codec if ours and strategy == 'fsdp' else 'none'}"])
    core = ComputeCore(cfg, torch.device("cpu"), Topology(rank, WORLD, 1, ("n0",) * WORLD))
    rec, ratio = None, None
    if strategy == "ddp":
        rec, ratio = _install_ddp_hook(core, codec, cfg)
    elif codec == "torch_fsdp_reduce_bf16":
        _fsdp_reduce_in_bf16(core.model)
    t = cfg.train
    per = t.batch_size
    losses: list[float] = []
    started = time.perf_counter()
    for i in range(steps):
        rows = batches[(i * WORLD * per) % (len(batches) - WORLD * per):][:WORLD * per]
        local = rows[rank * per:(rank + 1) * per]
        lr = t.lr * lr_factor(i, t.warmup_steps, steps, t.min_lr_ratio)
        loss, _ = core.step(lambda batch=local: batch, lr=lr)
        losses.append(_mean_over_ranks(loss))
    train_s = time.perf_counter() - started
    heldout_loss = _heldout_loss(core, rank, val, per, heldout)  # before the overlap timing steps change the model
    memory = core.memory()
    if strategy == "fsdp":
        stats = core.comm_stats()
        # FSDP's own reduce-scatter: fp32 by definition, bf16 half of it.
        wire = stats["wire_ratio"] if stats else (0.5 if codec == "torch_fsdp_reduce_bf16" else 1.0)
    else:
        assert ratio is not None
        wire = ratio(steps)
    result: dict[str, Any] = {
        "final_loss": float(np.mean(losses[-min(LAST, len(losses)):])), "first_loss": losses[0],
        "heldout_loss": heldout_loss,
        "wire_ratio": wire, "state_bytes_per_worker": memory["state_bytes"] + (_hook_state_bytes(rec) if rec else 0),
        "residual_bytes": memory["residual_bytes"], "train_s": round(train_s, 2),
    }
    if rec is not None and isinstance(rec.state, powerSGD_hook.PowerSGDState):
        # The rank matched int4_sparse's steady bytes (after its warm-up): both figures are in the JSON.
        result["powersgd_rank"] = rec.state.matrix_approximation_rank
        result["matched_wire_ratio"] = sparse_wire_ratio(cfg.compression.density)
    if job.timed_rounds:
        step_rows = batches[:WORLD * per]
        batch, lr = (lambda: step_rows[rank * per:(rank + 1) * per]), t.lr * t.min_lr_ratio
        result.update(_overlap(core, rec, batch, lr, job.timed_rounds) if rec is not None
                      else _fsdp_overlap(core, batch, lr, job.timed_rounds))
    return result


@dataclasses.dataclass(frozen=True)
class Job:
    """One training run of the bench: a codec under a strategy from a seed (timed_rounds: overlap rounds after it)."""

    seed: int
    strategy: str
    codec: str
    timed_rounds: int = 0

    @property
    def key(self) -> str:
        return f"{self.strategy}/{self.codec}"


def _rank_main(rank: int, port: int, jobs: list[Job], batches: dict[int, np.ndarray], overrides: list[str],
               steps: int, val: np.ndarray, heldout: int, out: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # one core per rank
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    results: dict[tuple[int, str], Any] = {}
    try:
        for job in jobs:
            try:
                r = results[job.seed, job.key] = _train(rank, job, batches[job.seed], overrides, steps, val, heldout)
                if rank == 0:  # progress for the person waiting (the parent's log is in another process)
                    print(f"seed {job.seed} {job.strategy} {job.codec}: loss {r['first_loss']:.3f} -> "
                          f"{r['final_loss']:.3f}, held-out {r['heldout_loss']:.4f}, wire ratio {r['wire_ratio']:.4f}, "
                          f"{r['train_s']:.0f} s", file=sys.stderr, flush=True)
            except Exception as exc:  # noqa: BLE001 - recorded as this codec's first_error
                lines = [ln for ln in str(exc).splitlines() if ln.strip()]
                error = f"{type(exc).__name__}: {lines[0] if lines else ''}"
                results[job.seed, job.key] = {"first_error": error, "traceback": traceback.format_exc()}
                break  # the ranks' collectives are out of step after a failure
    finally:
        dist.destroy_process_group()
        out.put((rank, results))


def _seed_batches(batches: np.ndarray, seed: int, rows: int) -> np.ndarray:
    """The training rows of one seed, in its order: every codec of that seed reads the same ones."""
    order = np.random.default_rng(seed).permutation(len(batches))[:rows]
    return batches[order]


def _run_jobs(jobs: list[Job], batches: dict[int, np.ndarray], ov: list[str], steps: int, val: np.ndarray,
              heldout: int) -> dict[tuple[int, str], Any]:
    """Run the jobs in order on 2 fresh gloo ranks; {(seed, strategy/codec): rank 0's result or the first error}."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, jobs, batches, ov, steps, val, heldout, out))
             for r in range(WORLD)]
    for p in procs:
        p.start()
    per_rank = dict(out.get(timeout=3600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    raw = per_rank[0]
    for key, r in per_rank.get(1, {}).items():  # a failure on rank 1 only is still a failure
        if "first_error" in r and "first_error" not in raw.get(key, {}):
            raw[key] = r
    return raw


def _paired_deltas(raw: dict[tuple[int, str], Any], strategy: str, codec: str, loss: str) -> list[float]:
    """Per seed that ran both: 100 x (codec - none) / none of `loss`, the seed's own none as the base."""
    out = []
    for (seed, key), r in sorted(raw.items()):
        base = raw.get((seed, f"{strategy}/none"), {}).get(loss)
        if key == f"{strategy}/{codec}" and base and r.get(loss) is not None:
            out.append(100 * (r[loss] - base) / base)
    return out


def _codec_result(raw: dict[tuple[int, str], Any], strategy: str, codec: str) -> dict[str, Any]:
    """One codec's figures over its seeds: medians, the paired held-out delta's interval and its verdict."""
    runs = [r for (_, key), r in sorted(raw.items()) if key == f"{strategy}/{codec}"]
    errors = [r for r in runs if "first_error" in r]
    if not runs or errors:
        return {k: v for k, v in (errors[0] if errors else {"first_error": "not run: an earlier run failed"}).items()
                if k != "traceback"}
    res: dict[str, Any] = {k: v for k, v in runs[0].items() if k not in ("heldout_loss", "final_loss", "wire_ratio")}
    res["seeds"] = len(runs)
    for name in ("heldout_loss", "final_loss", "wire_ratio"):
        res[name] = statistics.median(r[name] for r in runs)
    deltas = _paired_deltas(raw, strategy, codec, "heldout_loss")
    res.update(stats.summarize("heldout_loss_delta_pct", deltas, difference=True) if deltas else
               {"heldout_loss_delta_pct": math.nan, "heldout_loss_delta_pct_interval": list(stats.NAN_INTERVAL)})
    final = _paired_deltas(raw, strategy, codec, "final_loss")
    res["loss_delta_pct"] = statistics.median(final) if final else math.nan
    res["verdict"] = stats.noninferiority(tuple(res["heldout_loss_delta_pct_interval"]), MARGIN_PCT)
    return res


def _table(raw: dict[tuple[int, str], Any], strategy: str, codecs: tuple[str, ...]) -> dict[str, Any]:
    """A strategy's codecs, and the noise floor: its near-lossless peer's paired held-out delta."""
    res = {c: _codec_result(raw, strategy, c) for c in codecs}
    noise = res.get(NOISE_PEERS[strategy], {})
    floor = {"noise_floor_pct": noise.get("heldout_loss_delta_pct", math.nan),
             "noise_floor_pct_interval": noise.get("heldout_loss_delta_pct_interval", list(stats.NAN_INTERVAL))}
    none = [r["heldout_loss"] for (_, key), r in sorted(raw.items()) if key == f"{strategy}/none" and "heldout_loss" in r]
    # none's own held-out loss from seed to seed, as % of its mean: what a seed alone moves.
    floor["seed_spread_pct"] = (100 * statistics.stdev(none) / statistics.fmean(none)) if len(none) > 1 else math.nan
    return {"codecs": res, **floor}


def _inconclusive(raw: dict[tuple[int, str], Any]) -> list[tuple[str, str]]:
    """(strategy, codec) of cs3ray's codecs whose verdict is still inconclusive."""
    return [(s, c) for s in ("ddp", "fsdp") for c in OURS
            if _codec_result(raw, s, c).get("verdict") == stats.INCONCLUSIVE]


def _targets(ddp: dict[str, Any], fsdp: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """(flat figures, targets): each of cs3ray's codecs no worse than none within MARGIN_PCT, at its bytes."""
    figures: dict[str, Any] = {}
    targets: dict[str, Any] = {}
    for strategy, table in (("ddp", ddp), ("fsdp", fsdp)):
        for codec, wire in WIRE_TARGETS.items():
            c = table["codecs"][codec]
            delta, wire_key = f"{strategy}_{codec}_heldout_loss_delta_pct", f"{strategy}_{codec}_wire_ratio"
            figures[delta] = c.get("heldout_loss_delta_pct", math.nan)
            figures[f"{delta}_interval"] = c.get("heldout_loss_delta_pct_interval", list(stats.NAN_INTERVAL))
            figures.update(stats.exact(wire_key, c.get("wire_ratio", math.nan)))
            targets[delta] = {"at_most": MARGIN_PCT}
            targets[wire_key] = {"at_most": wire}
    return figures, targets


def run(quick: bool = False, steps: int | None = None, seeds: int | None = None, overrides: tuple[str, ...] = (),
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train every codec from each seed (2 ranks, in-process gloo) and return the JSON-able result."""
    started = time.perf_counter()
    steps = steps or (QUICK_STEPS if quick else STEPS)
    seeds = seeds or (QUICK_SEEDS if quick else SEEDS)
    rounds = QUICK_TIMED_ROUNDS if quick else TIMED_ROUNDS
    ov = [*(QUICK_SHAPE if quick else SHAPE), "compression.warmup_steps=0", *overrides]
    cfg = load_config(CONFIG, ov)
    log(f"preparing data for {CONFIG}")
    shards, manifest = prepare_data(cfg)
    train_rows = read_split(shards, manifest, "train")
    val = read_split(shards, manifest, "val")
    heldout = QUICK_HELDOUT if quick else HELDOUT
    need = steps * WORLD * cfg.train.batch_size + WORLD * cfg.train.batch_size
    batches = {s: _seed_batches(train_rows, s, need) for s in range(MAX_SEEDS)}
    jobs = [Job(seed, strategy, codec, rounds if seed == 0 else 0)
            for seed in range(seeds)
            for strategy, codecs in (("ddp", DDP_CODECS), ("fsdp", FSDP_CODECS)) for codec in codecs
            if seed == 0 or codec not in FIRST_SEED_ONLY]
    log(f"{len(jobs)} runs of {steps} steps ({seeds} seeds), {WORLD} ranks (gloo), batch {cfg.train.batch_size} x "
        f"{cfg.train.seq_len} per rank")
    raw = _run_jobs(jobs, {s: batches[s] for s in range(seeds)}, ov, steps, val, heldout)
    ran = seeds
    # Inconclusive: one more seed of none and the undecided codecs, while a seed of them fits the budget.
    per_run_s = (time.perf_counter() - started) / max(1, len(jobs))
    while not quick and ran < MAX_SEEDS and not any("first_error" in r for r in raw.values()):
        undecided = _inconclusive(raw)
        strategies = {s for s, _ in undecided}
        extra = [Job(ran, s, "none") for s in ("ddp", "fsdp") if s in strategies]
        extra += [Job(ran, s, c) for s, c in undecided]
        if not extra or time.perf_counter() - started + per_run_s * len(extra) > BUDGET_S:
            break
        log(f"inconclusive: {', '.join(f'{s} {c}' for s, c in undecided)}; seed {ran} of them and none")
        raw.update(_run_jobs(extra, {ran: batches[ran]}, ov, steps, val, heldout))
        ran += 1
    for key, r in raw.items():
        if "traceback" in r:
            log(f"{key} failed:\n{r['traceback']}")
    ddp, fsdp = _table(raw, "ddp", DDP_CODECS), _table(raw, "fsdp", FSDP_CODECS)
    figures, targets = _targets(ddp, fsdp)
    result = {
        "config": CONFIG, "overrides": ov, "precision": resolve_precision(cfg.precision, torch.device("cpu")),
        "ranks": WORLD, "steps": steps, "seeds": seeds, "seeds_run": ran, "final_loss_of_last": LAST,
        "timed_rounds": rounds, "heldout_batches_per_rank": heldout, "margin_pct": MARGIN_PCT,
        **ddp, "fsdp": fsdp, **figures, "targets": targets, "method": METHOD,
    }
    result["verdicts"] = stats.judge(result, targets)
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


METHOD = (f"per seed every arm starts from the same weights and reads the same batches; held-out loss delta = "
          f"100 x (codec - none) / none per seed, paired; its median over seeds and a 95% Student's t interval of "
          f"the mean delta; verdict: no worse when the interval's upper bound is <= +{MARGIN_PCT:g}%, worse when its lower bound "
          f"is above it, else inconclusive")


def title(r: dict[str, Any]) -> str:
    """The table's title: the run and the verdict line."""
    return (f"gradient compression ({r['config']}, {r['steps']} steps, {r['seeds_run']} seeds, {r['ranks']} ranks, "
            f"{r['precision']}; noise floor (bf16 peer vs none) DDP {stats.shown(r, 'noise_floor_pct')}%, "
            f"FSDP2 {stats.shown(r['fsdp'], 'noise_floor_pct')}%; overlap: first seed): "
            + stats.verdict_line(r, digits=3))


def rows(r: dict[str, Any]) -> list[tuple]:
    """Table rows: strategy, codec, seeds, held-out loss, its paired delta [interval], verdict, final-loss delta,
    wire ratio, overlap, state MB per worker."""
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)
    out = []
    for strategy, codecs in (("ddp", r["codecs"]), ("fsdp", r["fsdp"]["codecs"])):
        for name, c in codecs.items():
            delta = (stats.shown(c, "heldout_loss_delta_pct") if "heldout_loss_delta_pct_interval" in c
                     else c.get("first_error", "-"))
            out.append((strategy, name, fmt(c.get("seeds"), "d"), fmt(c.get("heldout_loss"), ".4f"), delta,
                        c.get("verdict", "-"), fmt(c.get("loss_delta_pct"), "+.2f"), fmt(c.get("wire_ratio"), ".4f"),
                        fmt(c.get("overlap_fraction"), ".2f"), fmt((c.get("state_bytes_per_worker") or 0) / 1e6, ".2f")))
    return out

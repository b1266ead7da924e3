"""`cs3 plan --rehearse`: cs3ray's own training step at the target world size, on fake tensors.

The method of torchtitan's memory estimator: a fake process group of the target size (torch's
`FakeStore` backend, rank 0 of it) and `FakeTensorMode`, under which the real compute core
(cs3ray.core.engine: the model, the parallelization, AdamW, loss scaling, compression) builds and
runs whole steps, every micro-batch included. Fake tensors have shapes, dtypes and devices but
no memory, so 70B on 64 workers runs on a laptop. Two dispatch-level observers watch the step:
one records the bytes this rank's local tensors hold (the peak), one the bytes it hands to the
process group (ring-equivalent bytes sent per collective).

The figures are rank 0's: with FSDP every data-parallel rank holds the same shapes.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from cs3ray.config import JobConfig, load_config
from cs3ray.core.engine import ComputeCore
from cs3ray.core.memory import payload_bytes
from cs3ray.core.mesh import Topology
from cs3ray.core.pipeline import virtual_stages
from cs3ray.errors import UserError

from .device_probe import cs3ray_allocations_on
from .planner import PlanInput, accumulation

WORKERS_PER_NODE = 8  # the node size the rehearsal's topology assumes (GPU servers hold 8)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class LiveBytes(TorchDispatchMode):
    """Bytes of storages created during tracking that are still alive, and their peak.

    Storages are counted once each, from the tensors ops return (a DTensor's local shard), and
    dropped when they are freed or resized (FSDP2 frees its gathered parameters by resizing
    their storage to 0, which no op reports: `UntypedStorage.resize_` is wrapped meanwhile).
    """

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}
        self.current = self.peak = 0
        self._orig_resize: Callable[..., Any] | None = None

    def reset_peak(self) -> None:
        self.peak = self.current

    def _track(self, t: torch.Tensor) -> None:
        st = _local(t).untyped_storage()
        key = st._cdata
        if key in self.sizes:
            return
        self.sizes[key] = st.nbytes()
        self.current += self.sizes[key]
        self.peak = max(self.peak, self.current)
        weakref.finalize(st, self._freed, key)

    def _freed(self, key: int) -> None:
        self.current -= self.sizes.pop(key, 0)

    def _resized(self, st: torch.UntypedStorage, size: int) -> None:
        key = st._cdata
        if key in self.sizes:
            self.current += size - self.sizes[key]
            self.sizes[key] = size
            self.peak = max(self.peak, self.current)

    def __enter__(self) -> "LiveBytes":
        self._orig_resize = orig = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st: torch.UntypedStorage, size: int) -> Any:
            out = orig(st, size)
            tracker._resized(st, size)
            return out

        torch.UntypedStorage.resize_ = resize_  # type: ignore[method-assign]
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        torch.UntypedStorage.resize_ = self._orig_resize  # type: ignore[method-assign]
        super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out


def _gathered_bytes(model: torch.nn.Module, live: LiveBytes, before: dict[int, int]) -> int:
    """Bytes of parameters the forward gathered and FSDP keeps gathered after it (the last block's): the
    plan counts them in gather_bytes, not among the activations. FSDP2 regrows the same storages each
    step, so what counts is each one's growth."""
    keys = {_local(p).untyped_storage()._cdata for p in model.parameters()}
    return sum(max(0, live.sizes.get(k, 0) - before.get(k, 0)) for k in keys)


def _group_size(func: Any, args: tuple) -> int:
    from torch._C._distributed_c10d import ProcessGroup

    if func.namespace == "_c10d_functional":  # tensor parallelism's collectives name their group
        from torch.distributed.distributed_c10d import _resolve_process_group

        names = [a for a in args if isinstance(a, str)]  # (a reduce op's name, then the group's)
        return _resolve_process_group(names[-1]).size() if names else 1
    for a in args:
        if isinstance(a, torch.ScriptObject):
            try:
                return ProcessGroup.unbox(a).size()
            except RuntimeError:
                continue  # a ReduceOp or options, not the group
    return 1


# The collectives by what they move, as torch's process-group ops (c10d) and functional ones name them.
_GATHERS = {"_allgather_base_", "allgather_", "allgather_into_tensor_coalesced_", "all_gather_into_tensor",
            "all_gather_into_tensor_coalesced"}
_SCATTERS = {"_reduce_scatter_base_", "reduce_scatter_", "reduce_scatter_tensor_coalesced_",
             "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"}
_REDUCES = {"allreduce_", "all_reduce", "all_reduce_coalesced"}


class SentBytes(TorchDispatchMode):
    """Bytes this rank sends per collective handed to the process group, as a ring moves them."""

    def __init__(self) -> None:
        super().__init__()
        self.by_op: dict[str, int] = {}
        self.largest_gather = self.largest_scatter = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's signature
        out = func(*args, **(kwargs or {}))
        if func.namespace in ("c10d", "_c10d_functional"):
            name, n = func._opname, _group_size(func, args)
            functional = func.namespace == "_c10d_functional"
            sent = 0
            if name in _GATHERS:
                # This rank's shard, to every other rank (a functional gather returns what the c10d one fills).
                shard, gathered = (args[0], out) if functional else (args[1], args[0])
                sent = (n - 1) * payload_bytes(shard)
                self.largest_gather = max(self.largest_gather, payload_bytes(gathered))
            elif name in _SCATTERS:
                # (N-1)/N of the input: N-1 chunks of the output's size.
                chunk = out if functional else args[0]
                sent = (n - 1) * payload_bytes(chunk)
                self.largest_scatter = max(self.largest_scatter, n * payload_bytes(chunk))
            elif name in _REDUCES:
                sent = round(2 * (n - 1) / n * payload_bytes(args[0]))
            elif name == "send":
                sent = payload_bytes(args[0])
            elif name == "broadcast_":
                sent = round((n - 1) / n * payload_bytes(args[0]))  # a chain: every rank but the last forwards it
            elif name in ("alltoall_base_", "all_to_all_single"):
                sent = round((n - 1) / n * payload_bytes(args[0 if functional else 1]))
            if sent:
                self.by_op[name] = self.by_op.get(name, 0) + sent
        return out


def _in_flight(cfg: JobConfig) -> int:
    """Forwards of one stage whose activations pipeline rank 0 holds at once (each forward is measured
    alone): every micro-batch with gpipe, as many as there are ranks with 1f1b; with the interleaved
    schedule torch's warm-up forwards of rank 0, (v - 1) pp + 2 (pp - 1), and the first steady one."""
    p = cfg.parallel
    if p.pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return p.pp_microbatches
    v = virtual_stages(p.pp_schedule)
    if v == 1:
        return min(p.pp, p.pp_microbatches)
    return min(v * p.pp_microbatches, (v - 1) * p.pp + 2 * (p.pp - 1) + 1)


def _completed_allreduce(process_group: Any, tensor: torch.Tensor) -> torch.futures.Future:
    """torch's default DDP hook's all-reduce, done at once: a fake group's future carries no value."""
    dist.all_reduce(tensor, group=process_group)
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(tensor)
    return fut


class _KeptBuckets:
    """DDP's reducer without its bucket rebuild after the first step: the rebuild agrees on the new order by
    exchanging index tensors whose values a fake group cannot carry. The buckets hold the same bytes."""

    def __init__(self, reducer: Any) -> None:
        self.__dict__["_reducer"] = reducer

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False


@contextlib.contextmanager
def _without_values() -> Any:
    """What torch's DDP and device meshes read from tensor values while they set up, done without them:
    DDP's check that every rank has the same parameter shapes (they do: the same code built them), its
    built-in all-reduce's result, and a mesh's own rank table (small host integers, kept real)."""
    import torch.nn.parallel.distributed as ddp_module
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.device_mesh import DeviceMesh

    mesh_init = DeviceMesh.__init__

    def init_mesh(self: DeviceMesh, *args: Any, **kwargs: Any) -> None:
        with unset_fake_temporarily():
            mesh_init(self, *args, **kwargs)

    saved = [(ddp_module, "_verify_param_shape_across_processes", lambda *_a, **_k: None),
             (default_hooks, "_allreduce_fut", _completed_allreduce), (DeviceMesh, "__init__", init_mesh),
             *_pipeline_without_values()]
    originals = [(owner, name, getattr(owner, name)) for owner, name, _ in saved]
    try:
        for owner, name, value in saved:
            setattr(owner, name, value)
        yield
    finally:
        for owner, name, value in originals:
            setattr(owner, name, value)


def _pipeline_without_values() -> list[tuple[Any, str, Any]]:
    """torch's pipeline schedule, set up without the other stages: its vote on how stages learn each
    other's shapes (every stage infers them from its own forward), and the shapes a neighbour would send.
    Hidden states have one shape and dtype between every two stages, and a gradient is shaped like its
    activation, so this rank's own stages say what the others would have sent."""
    from torch.distributed.pipelining import schedules, stage
    from torch.distributed.pipelining._utils import (
        InferenceMode,
        _derive_grad_metas,
        _StageBackwardMeta,
        _StageForwardMeta,
    )

    sent: list[Any] = []  # the forward metadata this rank's stages sent on

    def vote(_schedule: Any, stages: list[Any], *_args: Any) -> None:
        for s in stages:
            s._inference_mode = InferenceMode.DYNAMIC

    def send_meta(_stage: Any, meta: Any, _dst: int) -> None:
        if isinstance(meta, _StageForwardMeta):
            sent.append(meta)

    def recv_meta(st: Any, src: int) -> Any:
        if src > st.stage_index:
            return _StageBackwardMeta(backward_metas=_derive_grad_metas(st._stage_meta.outputs))
        if not sent:
            raise UserError("--rehearse: a pipeline stage's input shape is unknown before the first stage has run")
        return _StageForwardMeta(forward_metas=sent[-1].forward_metas)

    return [(schedules._PipelineSchedule, "_warmup_p2p", vote), (stage.PipelineStage, "_send_meta", send_meta),
            (stage.PipelineStage, "_recv_meta", recv_meta)]


def _rehearsable_ddp(core: ComputeCore) -> None:
    """DDP modules of the core with torch's Python all-reduce hook in place of the built-in one (the same
    bytes, through `_without_values`' all-reduce) and their buckets kept."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP

    modules = [core.model, *(core.pipeline.chunks.values() if core.pipeline is not None else ())]
    for m in {id(m): m for m in modules if isinstance(m, DDP)}.values():
        if core.compression is None:
            m.register_comm_hook(m.process_group, allreduce_hook)
        m.reducer = _KeptBuckets(m.reducer)


def rehearse(cfg: JobConfig, workers: int, steps: int = 2, device_check: bool = False) -> dict[str, Any]:
    """Rank 0's bytes in `steps` steps of `cfg` on `workers` workers; the last step is the one measured.

    One rehearsal per process (a second of the same layout is fine): torch's DTensor caches keep the meshes
    of an earlier fake group, whose process groups are gone.

    device_check: the steps run with cs3ray's own device-less allocations on `meta`
    (ops.device_probe), so one that would land in host memory next to GPU data raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise UserError("--rehearse needs a process without a process group of its own")
    started = time.time()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=workers)
    try:
        nodes = tuple(f"n{r // WORKERS_PER_NODE}" for r in range(workers))
        topo = Topology(0, workers, cfg.parallel.tp, nodes, cfg.parallel.pp)
        mesh = topo.mesh("cpu")  # outside fake mode: the mesh's own tensors are read
        batch = np.zeros((cfg.train.batch_size, cfg.train.seq_len + 1), dtype=np.int64)
        live, sent = LiveBytes(), SentBytes()
        forward: list[int] = []  # live bytes before the model's forward, then what it added (activations)
        before: dict[int, int] = {}  # the storages alive when the forward starts, and their sizes
        with FakeTensorMode(allow_non_fake_inputs=True), _without_values():
            with live:  # built on the device it is given (`torch.device` as the default), so never probed
                core = ComputeCore(cfg, torch.device("cpu"), topo, mesh=mesh)
            _rehearsable_ddp(core)

            def forward_starts(*_: Any) -> None:
                forward.append(live.current)
                before.clear()
                before.update(live.sizes)

            # What a stage's forward adds (with the interleaved schedule a rank runs several stages, one at a time).
            for stage in core.pipeline.chunks.values() if core.pipeline is not None else [core.model]:
                stage.register_forward_pre_hook(forward_starts, prepend=True)  # before FSDP gathers the root
                stage.register_forward_hook(lambda *_, stage=stage: forward.append(
                    live.current - forward.pop() - _gathered_bytes(stage, live, before)))
            if core.compression is not None:
                reduce = core.compression.reduce
                reduce.inline = True  # fake mode and the observers are this thread's
                # Rehearse a steady compressed step: past the fp32 warm-up and DGC's falling density.
                dgc = getattr(core.compression, "dgc", None)
                core.compression.steps = cfg.compression.warmup_steps + (dgc.warmup_steps if dgc else 0)
                # Measured in the steady state: DDP's first sync is fp32, the second makes the residuals,
                # the third (fp16) their spare buffers.
                steps = max(steps, 4)
                scatter = reduce.reduce_scatter

                def observed(key: Any, flat: torch.Tensor, *args: Any, **kwargs: Any) -> None:
                    sent.largest_scatter = max(sent.largest_scatter, payload_bytes(flat))
                    scatter(key, flat, *args, **kwargs)

                reduce.reduce_scatter = observed  # FSDP's compressed reduce-scatter: its input is the unit's gradient
            for i in range(steps):
                measured = i == steps - 1
                forward.clear()
                probe = cs3ray_allocations_on("meta") if device_check else contextlib.nullcontext()
                with live, sent if measured else contextlib.nullcontext(), probe:
                    live.reset_peak()
                    core.step(lambda: batch, lr=cfg.train.lr)
        owned = core.memory()
        held = {"param_bytes": owned["param_bytes"], "grad_bytes": owned["grad_bytes"],
                "optimizer_bytes": owned["optim_bytes"], "residual_bytes": owned["residual_bytes"],
                "activation_bytes": max(forward, default=0) * _in_flight(cfg)}
        return {"workers": workers, "params": core.n_params, "rehearsal_s": round(time.time() - started, 1),
                "per_worker": {**held, "model_state_bytes": held["param_bytes"] + held["grad_bytes"]
                               + held["optimizer_bytes"], # A unit's gathered parameters and its unsharded gradients, the plan's gather_bytes.
                               "gather_bytes": sent.largest_gather + sent.largest_scatter,
                               # The rest of the peak: gathered parameters and their gradients, the loss's
                               # fp32 logits, collective and optimizer buffers (if positive at the peak).
                               "temporary_bytes": max(0, live.peak - sum(held.values())),
                               "total_bytes": live.peak},
                "comm_bytes_per_step": sum(sent.by_op.values()), "comm_bytes_by_op": sent.by_op}
    finally:
        dist.destroy_process_group()


def rehearse_scaled(cfg: JobConfig, workers: int, layers: int | None = None) -> dict[str, Any]:
    """rehearse(), or with `layers` fewer than the model's: rehearsals of `layers` and 2 x `layers` blocks,
    every figure extended linearly to all blocks (each block adds the same bytes)."""
    total = cfg.model.args().n_layers
    if layers is None or layers * 2 > total:
        return {**rehearse(cfg, workers), "layers_rehearsed": [total]}
    runs = [rehearse(cfg.model_copy(update={"model": cfg.model.model_copy(update={"n_layers": k})}), workers)
            for k in (layers, 2 * layers)]

    def extend(a: int, b: int) -> int:
        return round(a + (b - a) / layers * (total - layers))

    out = {**runs[1], "layers_rehearsed": [layers, 2 * layers],
           "rehearsal_s": round(runs[0]["rehearsal_s"] + runs[1]["rehearsal_s"], 1)}
    out["per_worker"] = {k: extend(runs[0]["per_worker"][k], v) for k, v in runs[1]["per_worker"].items()}
    out["comm_bytes_per_step"] = extend(runs[0]["comm_bytes_per_step"], runs[1]["comm_bytes_per_step"])
    out["comm_bytes_by_op"] = {k: extend(runs[0]["comm_bytes_by_op"].get(k, 0), v)
                               for k, v in runs[1]["comm_bytes_by_op"].items()}
    out["params"] = extend(runs[0]["params"], runs[1]["params"])
    return out


def plan_config(p: PlanInput, workers: int) -> JobConfig:
    """The job config a plan's inputs describe: the shape, precision, layout, batch and codec."""
    if p.pp > 1 and p.micro_batch % p.pp:
        raise UserError(f"--rehearse with --pp {p.pp} runs each micro-batch as {p.pp} pipeline micro-batches: "
                        f"give --micro-batch a multiple of {p.pp}")
    a, dp = p.args, max(1, workers // p.mp)
    overrides = {
        "model.dim": a.dim, "model.n_layers": a.n_layers, "model.n_heads": a.n_heads, "model.n_kv_heads": a.kv_heads,
        "model.ffn_dim": a.ffn_dim, "model.vocab_size": a.vocab_size, "model.max_seq_len": a.max_seq_len,
        "model.rope_theta": a.rope_theta, "model.tie_embeddings": str(a.tie_embeddings).lower(),
        "precision": p.precision, "parallel.strategy": p.strategy, "parallel.tp": p.tp, "parallel.pp": p.pp,
        "parallel.fsdp_unsharded_accumulation": str(p.unsharded_accumulation).lower(),
        "compression.codec": p.codec, "compression.density": p.density,
        "compression.error_feedback": str(p.error_feedback).lower(), "cluster.workers": workers,
        "train.seq_len": p.seq_len or a.max_seq_len, "train.batch_size": p.micro_batch,
        "train.grad_accum": accumulation(p, dp), "train.activation_checkpointing": str(p.activation_checkpointing).lower(),
    }
    if p.pp > 1:  # the plan's 1f1b: pp micro-batches of micro_batch / pp sequences
        overrides |= {"parallel.pp_microbatches": p.pp, "parallel.pp_schedule": "1f1b"}
    return load_config(None, [f"{k}={v}" for k, v in overrides.items()])


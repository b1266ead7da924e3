"""The compute core of one rank: a model with parallelism applied, its optimizer and precision.

It knows nothing of Ray: the Ray worker feeds it batches, and tests drive it under plain
torch.distributed processes to compare every strategy with a single-process run.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from cs3ray.config import JobConfig
from cs3ray.models.factory import count_parameters, model_from_config

from . import parallel
from .busy import BusyClock
from .compress import CompressionHook
from .fake import host_float
from .freeze import apply_freeze
from .grads import clip_grad_norm
from .memory import owned_bytes, peak_step_memory
from .mesh import Topology
from .optim import build_optimizer, set_lr
from .pipeline import TIED_ALIASES, Pipeline, autocast_forward, tied_last_stage, virtual_stages
from .precision import LossScaler, autocast, resolve_precision
from .state import capture, init_adamw_state, local_optimizer, restore

log = logging.getLogger(__name__)


class ComputeCore:
    """Builds and steps one rank's shard of the model; every method is called on every rank."""

    def __init__(self, cfg: JobConfig, device: torch.device, topology: Topology, mesh: Any = None) -> None:
        """mesh: the topology's device mesh when the caller built it (a rehearsal builds it outside fake mode)."""
        self.cfg, self.device, self.topo = cfg, device, topology
        self.precision = resolve_precision(cfg.precision, device)
        p, t = cfg.parallel, cfg.train
        torch.manual_seed(t.seed)  # identical initial weights on every rank
        # Built on its device: no host copy of the weights on GPUs, and a rehearsal's fake tensors
        # (which cannot be swapped for others) start where they stay.
        with torch.device(device):
            model = model_from_config(cfg)
        if any(q.device != device for q in model.parameters()):
            model = model.to(device)  # a model.target that places its own tensors
        self.n_params = count_parameters(model)
        # Freezing comes before any wrapping and before the optimizer: frozen parameters get
        # no gradient buckets and no optimizer state.
        self.frozen = apply_freeze(model, t.freeze)
        if mesh is None and dist.is_initialized():
            mesh = topology.mesh(device.type)
        self.mesh = mesh
        distributed = mesh is not None and topology.world > 1
        # The fixed order of parallelisms (see cs3ray.core.parallel).
        # The modules a pipeline schedule runs: the model, or with pipeline parallelism this rank's stages
        # (with more than one, `model` holds them all under their own names, for the optimizer and checkpoints).
        chunks = [model]
        if p.pp > 1:
            model, chunks = parallel.apply_pp(model, topology.pp_rank, p.pp, virtual_stages(p.pp_schedule))
        self.stage_params = count_parameters(model)  # this rank's pipeline stages (the whole model without pp)
        if p.tp > 1:
            parallel.apply_tp(model, mesh["tp"])
        for chunk in chunks:
            if t.activation_checkpointing:
                parallel.apply_ac(chunk)
            if t.compile:
                parallel.apply_compile(chunk)
        self.autocast = True
        self.compression: CompressionHook | None = None  # compressed gradient sync
        self.fsdp = p.strategy == "fsdp" and distributed
        # FSDP2 holds unsharded gradients across micro-batches whose sync is off: only where asked.
        self.sync_every_micro_batch = self.fsdp and not p.fsdp_unsharded_accumulation
        if self.fsdp:
            for chunk in chunks:
                parallel.apply_fsdp(chunk, mesh["dp"], self.precision)
            self.compression = parallel.apply_fsdp_compression(model, cfg.compression, mesh["dp"].get_group(),
                                                               topology, clip=cfg.train.clip)
            self.autocast = False  # FSDP's MixedPrecisionPolicy casts the gathered parameters
        elif distributed and topology.dp > 1:
            group = mesh["dp"].get_group() if p.tp > 1 or p.pp > 1 else None
            chunks = [parallel.apply_ddp(chunk, device, group=group) for chunk in chunks]
            model = chunks[0] if len(chunks) == 1 else model
            self.compression = parallel.apply_compression(model, cfg.compression, group, topology, clip=cfg.train.clip)
        self.model = model  # train.init_from weights are loaded into it by the worker (cs3ray.train.loop)
        # DDP's gradients are views of its buckets: zeroed in place, they stay so. Set to None, the first
        # micro-batch of an accumulation (no_sync) would allocate a second copy beside the buckets.
        self._grads_to_none = not any(isinstance(c, DDP) for c in chunks)
        self.pipeline: Pipeline | None = None
        # Optimizer state of the last stage's copy of a tied embedding is saved under the embedding's name.
        self.aliases = TIED_ALIASES if tied_last_stage(getattr(model, "module", model), topology.pp_rank, p.pp) \
            else None
        if p.pp > 1:
            if self.autocast and self.precision != "fp32":
                for chunk in chunks:
                    autocast_forward(getattr(chunk, "module", chunk), self.precision, device)
            self.pipeline = Pipeline(model, chunks, topology, mesh["pp"].get_group(), p.pp_schedule,
                                     p.pp_microbatches, device, sync_every_micro_batch=self.sync_every_micro_batch)
        betas = (t.beta1, t.beta2)
        if p.strategy == "zero1" and distributed and topology.dp > 1:
            self.optimizer = build_optimizer(model, t.lr, t.weight_decay, betas, zero_group=mesh["dp"].get_group())
        else:
            self.optimizer = build_optimizer(model, t.lr, t.weight_decay, betas)
        init_adamw_state(local_optimizer(self.optimizer))
        self.params = [q for q in model.parameters() if q.requires_grad]
        self.scaler = LossScaler(self.precision == "fp16")
        if self.compression is not None:
            # fp16 steps can be skipped on overflow: their residual updates must be undoable.
            self.compression.set_transactional(self.scaler.enabled)
        self.grad_accum = t.grad_accum  # the worker adapts it to keep the global batch on resizes
        # Fault-tolerant replicas (cs3ray.train.replicas) average gradients across replica groups
        # themselves and decide whether the step may be applied; None for ordinary runs.
        self.sync_grads: Callable[[list[torch.Tensor]], None] | None = None
        self.may_commit: Callable[[], bool] | None = None
        self.peak_bytes: int | None = None
        self.grad_bytes = 0
        self.grad_norm: float | None = None  # before clipping, of the last applied step (train.clip > 0)
        # train.balance: this rank's rows / the data-parallel mean rows, and the compute time of its steps.
        self.sample_weight = 1.0
        self.busy = BusyClock(device)

    def _forward_loss(self, x: torch.Tensor) -> torch.Tensor:
        ctx = autocast(self.precision, self.device) if self.autocast else contextlib.nullcontext()
        with ctx:
            logits = self.model(x[:, :-1])
        return F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())

    def _no_sync(self, last: bool):
        """Skip gradient communication on all but the last micro-batch of an accumulation (not FSDP's by default)."""
        if last or self.sync_every_micro_batch:
            return contextlib.nullcontext()
        if hasattr(self.model, "no_sync"):
            return self.model.no_sync()
        if hasattr(self.model, "set_requires_gradient_sync"):  # FSDP2
            self.model.set_requires_gradient_sync(False)
        return contextlib.nullcontext()

    def step(self, next_batch: Callable[[], np.ndarray], lr: float, track_memory: bool = False) -> tuple[float, bool]:
        """One optimizer step over grad_accum micro-batches: (mean loss on this rank, step applied)."""
        # torch's MemTracker follows one forward per tracked step, so accumulation and pipeline
        # micro-batches run untracked on CPUs (CUDA's allocator counters see any step).
        if track_memory and self.grad_accum == 1 and (self.pipeline is None or self.device.type == "cuda"):
            result, self.peak_bytes = peak_step_memory(lambda: self._step(next_batch, lr), self.model,
                                                       self.optimizer, self.device)
            return result
        return self._step(next_batch, lr)

    def _step(self, next_batch: Callable[[], np.ndarray], lr: float) -> tuple[float, bool]:
        t = self.cfg.train
        set_lr(self.optimizer, lr)
        if self.pipeline is not None:
            return self._pipeline_step(next_batch)
        total = 0.0
        self.busy.begin()
        if self.compression is not None:
            self.compression.begin_step(self.scaler.scale)
        for micro in range(self.grad_accum):
            last = micro == self.grad_accum - 1
            if last and hasattr(self.model, "set_requires_gradient_sync"):
                self.model.set_requires_gradient_sync(True)
            x = torch.as_tensor(next_batch(), device=self.device)
            with self._no_sync(last):
                loss = self._forward_loss(x) / self.grad_accum
                # The data-parallel mean of weighted losses is the global batch's mean (train.balance).
                self.scaler.scale_loss(loss * self.sample_weight).backward()
            total += host_float(loss.detach())
        # Compute, not the wall's time: a wait for slower ranks in a collective is no work (cs3ray.core.busy).
        self.busy.end()
        if self.fsdp and self.compression is not None:
            self.compression.end_sync()
        if self.sync_grads is not None:
            self.sync_grads(self.params)
        ok = self.scaler.unscale_and_check(self.params)
        self.grad_bytes = owned_bytes(self.model, self.optimizer)["grad_bytes"]
        if self.may_commit is not None:
            ok = self.may_commit() and ok
        if self.compression is not None:
            self.compression.end_step(ok)
        if ok:
            if t.clip > 0:
                self.grad_norm = clip_grad_norm(self.params, t.clip)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self._grads_to_none)
        return total, ok

    def _pipeline_step(self, next_batch: Callable[[], np.ndarray]) -> tuple[float, bool]:
        """One optimizer step through the pipeline schedule: each accumulated batch is split into micro-batches."""
        pipe, t = self.pipeline, self.cfg.train
        total = 0.0
        for _ in range(self.grad_accum):
            x = torch.as_tensor(next_batch(), device=self.device)
            total += pipe.step(x, self.scaler.scale / self.grad_accum) / self.grad_accum
        pipe.sync_tied()
        # The found-inf flag is all-reduced over every rank: an overflow on any stage skips the step on all.
        ok = self.scaler.unscale_and_check(self.params)
        self.grad_bytes = owned_bytes(self.model, self.optimizer)["grad_bytes"]
        if ok:
            if t.clip > 0:
                # The global norm: each stage's sum of squares, added up over the pipeline.
                self.grad_norm = clip_grad_norm(self.params, t.clip, counted=pipe.norm_params(self.params),
                                                group=pipe.group)
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=self._grads_to_none)
        return total, ok

    def pipeline_window(self) -> dict[str, Any] | None:
        """Pipeline runs: this stage's idle share and every stage's time shares since the last call (a
        collective of the pipeline's ranks); None without pipeline parallelism."""
        return self.pipeline.window() if self.pipeline is not None else None

    @torch.no_grad()
    def evaluate(self, batches: list[np.ndarray]) -> tuple[float, int]:
        """(summed token loss, token count) over this rank's validation batches (0, 0 on pipeline stages but the last)."""
        self.model.eval()
        total, count = 0.0, 0
        for batch in batches:
            x = torch.as_tensor(batch, device=self.device)
            if self.pipeline is not None:
                loss = self.pipeline.forward_only(x)
                if loss is not None:
                    total += float(loss) * x[:, 1:].numel()
                    count += x[:, 1:].numel()
                continue
            total += float(self._forward_loss(x)) * x[:, 1:].numel()
            count += x[:, 1:].numel()
        self.model.train()
        self._reshard()
        return total, count

    def _reshard(self) -> None:
        """Put FSDP2 back into sharded state after a forward without backward.

        Without a backward, modules that keep parameters gathered after forward (the root and
        the last block) stay unsharded, and `named_parameters()` would then hand checkpoints
        and the optimizer the temporary full tensors instead of this rank's shards.
        """
        for module in self.model.modules():
            if hasattr(module, "reshard") and hasattr(module, "set_requires_gradient_sync"):
                module.reshard()

    def state(self) -> dict[str, Any]:
        """DCP state of this rank (references: loading fills them in place)."""
        return capture(self.model, self.optimizer, self.aliases)

    def after_load(self, state: dict[str, Any]) -> None:
        restore(self.model, state)

    def compression_state(self) -> dict[str, Any] | None:
        """This rank's error-feedback residuals for its per-rank checkpoint file (None without compression)."""
        return self.compression.state_dict() if self.compression else None

    def load_compression_state(self, state: dict[str, Any] | None, step: int) -> None:
        """Resume compression at optimizer step `step` with this rank's saved residuals.

        Residuals belong to one rank's buckets and chunks, so they come back only when the world
        size is unchanged (the per-rank file is read then); otherwise they start from zero, with a warning.
        """
        if self.compression is None:
            return
        if not self.compression.load_state_dict(state or {}, step) and self.cfg.compression.error_feedback:
            log.warning("compression: error-feedback residuals start from zero at step %d (the checkpoint has "
                        "none for this rank: world size or codec changed)", step)

    def comm_stats(self) -> dict[str, float | int | None] | None:
        """Gradient bytes this rank sent so far and their wire_ratio (compressed sync only)."""
        return self.compression.stats() if self.compression else None

    def memory(self) -> dict[str, int | None]:
        """Bytes this rank owns: parameters, gradients (as of the last step), optimizer state, peak."""
        owned = owned_bytes(self.model, self.optimizer)
        owned["grad_bytes"] = self.grad_bytes
        # Error-feedback residuals are one more fp32 copy of the gradients this rank syncs.
        owned["residual_bytes"] = self.compression.residual_bytes() if self.compression else 0
        owned["state_bytes"] = (owned["param_bytes"] + owned["grad_bytes"] + owned["optim_bytes"]
                                + owned["residual_bytes"])
        owned["peak_bytes"] = self.peak_bytes
        return owned

"""Pipeline parallelism: stages of the model on the ranks of a pipeline, run by a torch.distributed.pipelining
schedule (one stage per rank, or two with the interleaved schedule).

A stage is the unmodified model with the modules of other stages removed (torchtitan's way), so
every parameter keeps its fully-qualified name ("blocks.3.attn.wq.weight") and checkpoints reshard
across pipeline degrees without conversion. With tied embeddings the first stage's `tok_emb` and
the last stage's `output` hold two copies of one weight: their gradients are summed across the two
stages before the optimizer step, so the copies stay equal (Megatron's embedding group).
"""

from __future__ import annotations

import copy
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from .fake import host_float
from .precision import autocast

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
# Seconds this process spent posting and waiting on pipeline sends and receives (_install_p2p_clock).
_P2P_SECONDS = [0.0]
# The canonical name of a tied weight held by the last stage, for optimizer state in checkpoints.
TIED_ALIASES = {"output.weight": "tok_emb.weight"}


def virtual_stages(schedule: str) -> int:
    """Stages per pipeline rank: 2 for the interleaved schedule (rank r holds stages r and r + pp), else 1."""
    return 2 if schedule == "interleaved_1f1b" else 1


def rank_stages(rank: int, pp: int, virtual: int) -> list[int]:
    """The stage indices pipeline rank `rank` holds (torch's looped placement: stage s on rank s % pp)."""
    return [rank + v * pp for v in range(virtual)]


def rank_layers(n_layers: int, rank: int, pp: int, virtual: int) -> int:
    """Number of blocks pipeline rank `rank` holds over its stages."""
    return sum(len(stage_layers(n_layers, pp * virtual, s)) for s in rank_stages(rank, pp, virtual))


def stage_layers(n_layers: int, stages: int, stage: int) -> range:
    """Block indices of `stage`: contiguous, as even as possible, earlier stages taking the remainder."""
    base, extra = divmod(n_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (1 if stage < extra else 0))


def split_stage(model: nn.Module, stage: int, stages: int) -> nn.Module:
    """Keep only `stage`'s modules of a Transformer, in place: its blocks, the embedding in the first stage,
    norm and output in the last. Names of what is kept are unchanged."""
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict) or not all(hasattr(model, n) for n in ("tok_emb", "norm", "output")):
        raise ValueError("parallel.pp > 1 needs the built-in transformer (tok_emb, blocks, norm, output)")
    keep = {str(i) for i in stage_layers(len(blocks), stages, stage)}
    for name in list(blocks.keys()):
        if name not in keep:
            del blocks[name]
    if stage > 0:
        model.tok_emb = None
    if stage < stages - 1:
        model.norm = None
        model.output = None
    return model


def _stage_view(holder: nn.Module, stage: int, stages: int) -> nn.Module:
    """A module of `holder`'s class sharing its submodules, holding only `stage`'s: a schedule's stage of a
    rank that holds several. Its own hook and module tables, so wrapping it (FSDP, DDP) leaves `holder` alone."""
    view = copy.copy(holder)
    for key, value in vars(holder).items():
        if isinstance(value, (dict, set)):
            object.__setattr__(view, key, copy.copy(value))
    view.blocks = nn.ModuleDict(dict(holder.blocks.items()))
    return split_stage(view, stage, stages)


def split_rank(model: nn.Module, rank: int, pp: int, virtual: int = 1) -> tuple[nn.Module, list[nn.Module]]:
    """(The model pruned to pipeline rank `rank`'s modules, the stage modules the schedule runs)."""
    if virtual == 1:
        return split_stage(model, rank, pp), [model]
    stages = pp * virtual
    mine = rank_stages(rank, pp, virtual)
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, nn.ModuleDict):
        raise ValueError("parallel.pp > 1 needs the built-in transformer (tok_emb, blocks, norm, output)")
    keep = {str(i) for s in mine for i in stage_layers(len(blocks), stages, s)}
    views = [_stage_view(model, s, stages) for s in mine]  # before pruning: each view splits the whole model
    for name in list(blocks.keys()):
        if name not in keep:
            del blocks[name]
    if 0 not in mine:
        model.tok_emb = None
    if stages - 1 not in mine:
        model.norm = None
        model.output = None
    return model, views


def tied_last_stage(model: nn.Module, stage: int, stages: int) -> bool:
    """Whether this stage holds the output copy of a tied embedding (its optimizer state is the embedding's)."""
    args = getattr(model, "args", None)
    return bool(args is not None and args.tie_embeddings and stages > 1 and stage == stages - 1)


def autocast_forward(module: nn.Module, precision: str, device: torch.device) -> None:
    """Run `module`'s forward under autocast: the schedule calls it, so the caller cannot wrap it."""
    inner = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        with autocast(precision, device):
            return inner(*args, **kwargs)

    module.forward = forward


def _tied_group(topo: Any) -> Any:
    """The group of this rank's first and last stage (same data and tensor coordinates); every rank creates all."""
    mine = None
    per_stage = topo.dp * topo.tp
    for offset in range(per_stage):
        ranks = [offset, (topo.pp - 1) * per_stage + offset]
        group = dist.new_group(ranks)
        if topo.rank in ranks:
            mine = group
    return mine


def _sync_every_backward(module: nn.Module) -> None:
    """Keep an FSDP stage's gradients sharded between micro-batches, as outside pipelines.

    torch's schedule turns FSDP's gradient sync and resharding off for every micro-batch's backward and
    reduces once at the end: each stage then holds its whole gradient in fp32 and its gathered parameters
    until the step ends (70 GB and 35 GB a rank for a quarter of 70B). Here every backward reduce-scatters
    and reshards; the schedule's final reduce finds nothing left to reduce.
    """
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(module, FSDPModule):
        return
    for name in ("set_requires_gradient_sync", "set_reshard_after_backward"):
        setter = getattr(module, name)

        def always(_flag: bool, *args: Any, _setter: Callable[..., None] = setter, **kwargs: Any) -> None:
            _setter(True, *args, **kwargs)

        setattr(module, name, always)


def _install_p2p_clock() -> None:
    """Time the pipeline's sends and receives, the wait for the neighbouring stages included: torch's
    schedules post and wait on them through their module's `_batch_p2p` and `_wait_batch_p2p`."""
    from torch.distributed.pipelining import schedules

    for name in ("_batch_p2p", "_wait_batch_p2p"):
        fn = getattr(schedules, name)
        if getattr(fn, "_cs3_timed", False):
            continue

        def timed(*args: Any, _fn: Callable[..., Any] = fn, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                _P2P_SECONDS[0] += time.perf_counter() - t0
        timed._cs3_timed = True  # type: ignore[attr-defined]
        setattr(schedules, name, timed)


class Pipeline:
    """This rank's stage and schedule; `step` runs forward and backward over the micro-batches."""

    def __init__(self, module: nn.Module, chunks: list[nn.Module], topo: Any, pp_group: Any, schedule: str,
                 microbatches: int, device: torch.device, sync_every_micro_batch: bool = False) -> None:
        """sync_every_micro_batch: FSDP stages reduce-scatter each micro-batch's gradients (`_sync_every_backward`)."""
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        if schedule not in SCHEDULES:
            raise ValueError(f"parallel.pp_schedule={schedule} is not available; use one of {', '.join(SCHEDULES)}")
        self.rank, self.ranks = topo.pp_rank, topo.pp
        self.stage_ids = rank_stages(self.rank, self.ranks, len(chunks))
        self.stages = self.ranks * len(chunks)
        # Whether this rank holds the first stage (embedding) and the last (output, loss).
        self.first, self.last = self.rank == 0, self.rank == self.ranks - 1
        self.group, self.device, self.microbatches = pp_group, device, microbatches
        self.module, self.chunks = module, dict(zip(self.stage_ids, chunks, strict=True))
        self.pipe_stages = [PipelineStage(c, s, self.stages, device, group=pp_group)
                            for s, c in self.chunks.items()]
        if sync_every_micro_batch:
            for chunk in chunks:
                _sync_every_backward(chunk)
        # Gradients are scaled in the loss (by micro-batches and accumulation): torch's scale_grads
        # would divide gradients accumulated over earlier steps again.
        if schedule == "interleaved_1f1b":
            self.schedule = ScheduleInterleaved1F1B(self.pipe_stages, microbatches, loss_fn=self._loss,
                                                    scale_grads=False)
        else:
            cls = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = cls(self.pipe_stages[0], microbatches, loss_fn=self._loss, scale_grads=False)
        self._factor = 1.0
        self._losses: list[torch.Tensor] = []
        self.tied_params: list[nn.Parameter] = []
        self.tied_group = None
        args = getattr(getattr(module, "module", module), "args", None)
        if args is not None and args.tie_embeddings:
            self.tied_group = pp_group if self.ranks == 2 else _tied_group(topo)
            holder = "tok_emb" if self.first else "output" if self.last else None
            self.tied_params = [p for n, p in module.named_parameters()
                                if holder and n.split(".")[-2] == holder and p.requires_grad]
        # Seconds of this rank's steps since the last window: computing, in sends and receives, in all.
        self.compute_s = self.p2p_s = self.step_s = 0.0
        self._time_compute()
        _install_p2p_clock()

    def _time_compute(self) -> None:
        """Count the seconds spent in forward and backward chunks: the rest of a step is the bubble."""
        def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                t0 = time.perf_counter()
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.compute_s += time.perf_counter() - t0
            return run
        for stage in self.pipe_stages:
            stage.forward_one_chunk = timed(stage.forward_one_chunk)
            stage.backward_one_chunk = timed(stage.backward_one_chunk)
            if hasattr(stage, "backward_weight_one_chunk"):
                stage.backward_weight_one_chunk = timed(stage.backward_weight_one_chunk)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = F.cross_entropy(logits.float().flatten(0, 1), target.flatten())
        self._losses.append(loss.detach())
        return loss * self._factor

    def step(self, batch: torch.Tensor, factor: float) -> float:
        """Forward and backward of one batch (rows, seq+1) in micro-batches; the loss of each micro-batch
        is multiplied by `factor` for backward. Returns the mean loss over the micro-batches, on every stage."""
        self._factor = factor / self.microbatches
        self._losses = []
        t0, p2p0 = time.perf_counter(), _P2P_SECONDS[0]
        if self.first:
            self.schedule.step(batch[:, :-1], target=batch[:, 1:] if self.last else None)
        elif self.last:
            self.schedule.step(target=batch[:, 1:])
        else:
            self.schedule.step()
        self.step_s += time.perf_counter() - t0
        self.p2p_s += _P2P_SECONDS[0] - p2p0
        # The first step also infers stage shapes with a forward of its own: its loss is not a micro-batch's.
        losses = self._losses[-self.microbatches:]
        mean = torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)
        mean = mean.to(torch.float64)
        dist.all_reduce(mean, group=self.group)  # only the last stage has the loss
        return host_float(mean)

    def window(self) -> dict[str, Any] | None:
        """Where the pipeline's time went since the last call, on every rank of the pipeline (a collective
        of its group): `bubble_fraction`, this rank's share of its step time outside its forward and
        backward chunks, and `stage_time_shares`, per pipeline rank the shares computing, in sends and
        receives (the wait for the neighbouring stages included) and in the rest (the schedule's own work,
        the loss). None before the first step."""
        if self.step_s <= 0:
            return None
        shares = [self.compute_s / self.step_s, self.p2p_s / self.step_s]
        shares.append(max(0.0, 1.0 - sum(shares)))
        self.compute_s = self.p2p_s = self.step_s = 0.0
        mine = torch.tensor(shares, dtype=torch.float64, device=self.device)
        gathered = [torch.empty_like(mine) for _ in range(self.ranks)]
        dist.all_gather(gathered, mine, group=self.group)
        stages = [dict(zip(("compute", "p2p", "other"), (round(x, 4) for x in g.tolist()), strict=True))
                  for g in gathered]
        return {"bubble_fraction": max(0.0, 1.0 - shares[0]), "stage_time_shares": stages}

    def sync_tied(self) -> None:
        """Sum the tied embedding's gradient over its two copies (first and last stage)."""
        if self.tied_group is None or not self.tied_params:
            return
        for p in self.tied_params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=self.tied_group)

    def norm_params(self, params: list[torch.Tensor]) -> list[torch.Tensor]:
        """The parameters this stage counts in the global gradient norm: a tied weight once, on the first stage."""
        if not self.last or self.first or not self.tied_params:
            return params
        skip = {id(p) for p in self.tied_params}
        return [p for p in params if id(p) not in skip]

    @torch.no_grad()
    def forward_only(self, batch: torch.Tensor) -> torch.Tensor | None:
        """Forward of one batch through every stage with plain sends; the last stage's rank returns the mean loss."""
        h = batch[:, :-1]
        dim = getattr(self.module, "module", self.module).args.dim
        for stage, chunk in self.chunks.items():
            if stage > 0:
                # Hidden states travel in fp32: exact for fp32 and for bf16/fp16 activations alike.
                h = torch.empty(*batch[:, :-1].shape, dim, dtype=torch.float32, device=self.device)
                dist.recv(h, src=dist.get_global_rank(self.group, (stage - 1) % self.ranks))
            out = chunk(h)
            if stage < self.stages - 1:
                dist.send(out.float().contiguous(), dst=dist.get_global_rank(self.group, (stage + 1) % self.ranks))
        if not self.last:
            return None
        return F.cross_entropy(out.float().flatten(0, 1), batch[:, 1:].flatten())

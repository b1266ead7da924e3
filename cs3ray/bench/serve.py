"""`cs3 bench serve`: continuous batching vs. no batching vs. Serve's @serve.batch, in one run.

All three modes serve the same checkpoint with the same engine, forward pass and sampler on
one replica of 1 CPU each, behind the same HTTP ingress (Serve's Python proxy, as `cs3 serve` runs
it unless asked for --haproxy); they differ only in scheduling:
  unbatched    cs3ray's engine with max_batch=1 (one sequence at a time, the rest queue)
  serve_batch  Ray Serve's @serve.batch(max_batch_size=16, batch_wait_timeout_s=0.01): closed batches
  continuous   cs3ray's engine: sequences join and leave the batch at every decode step
Each offered concurrency replays one seeded open-loop workload against each mode in turn. The
concurrency the targets read (16, tiny model) does so in interleaved rounds, each round every
mode back to back in the opposite order to the round before, so each target is the median of
the rounds' own figures with a 95% interval (cs3ray.bench.stats) and a verdict.
Then, where HAProxy is installed, what the opt-in HAProxy ingress would change: continuous batching
replays the concurrency-16 workload twice on a second cluster with HAProxy in place of Serve's proxy
(`ingress`: both cells and HAProxy's tokens/s over the proxy's).
With --peer vllm, the tiny model also against vLLM standalone and through serve.engine=vllm, on the
same cores (serve_peer).
The benchmark needs no trained run: each model gets a few optimizer steps on the Python
standard library's source first (seconds), just enough that it writes text. Speed does not
depend on the weights (ignore_eos fixes every output's length), but streaming does: a
random-weight byte model often draws a byte that ends no UTF-8 character, or a special token,
and such a token streams nothing, so its gap is charged to the next one and inflates the p99
gap; a served model writes text. (figures: docs/benchmarks.md)
"""

from __future__ import annotations

import contextlib
import functools
import math
import tempfile
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from cs3ray.ckpt import CheckpointManager
from cs3ray.config import build_config, to_yaml
from cs3ray.core.precision import inference_dtype, resolve_precision
from cs3ray.data.corpus import STDLIB, open_corpus
from cs3ray.models import ByteTokenizer, Transformer
from cs3ray.ops.cluster_env import HAPROXY_SWITCH, export_cluster_env, haproxy_binary
from cs3ray.ops.ports import free_port
from cs3ray.ops.watchdog import watched_cluster
from cs3ray.serve.tuning import replica_actor_options

from . import serve_peer, stats
from .serve_load import Item, Replay, replay, run_load, summarize, workload

MODES = ("unbatched", "serve_batch", "continuous")
# A round replays the workload against every mode in this order, the next round in the opposite
# one, and a mode's cell pools its rounds' replays: with rounds measured before and after its
# peers, continuous batching sees the same stretch of a drifting host's time as they do.
ROUND_ORDER = ("continuous", "unbatched", "serve_batch")
CONCURRENCIES = (1, 4, 16, 64)
TARGET_CONCURRENCY = 16
CELL_KEYS = ("tokens_per_s", "p50_ttft_ms", "p99_ttft_ms", "p99_itl_ms", "errors")
TARGETS = {"speedup_vs_unbatched_at_16": {"at_least": 5.0}, "speedup_vs_serve_batch_at_16": {"at_least": 1.5},
           "p99_itl_ms_at_16": {"at_most": 50.0}}


# Optimizer steps before serving (batch 8 x 64 bytes): after this many, almost every sampled token
# streams text; small's steps are slow, so it gets fewer. (figures: docs/benchmarks.md)
TEXT_STEPS = {"tiny": 20, "small": 8}


@functools.cache
def _stdlib_bytes() -> torch.Tensor:
    """~2 MB of the standard library's source as bytes, read once per run (both models train on it)."""
    return torch.frombuffer(bytearray("".join(open_corpus(STDLIB).documents(2_000_000)).encode()), dtype=torch.uint8)


def _writes_text(model: Transformer, steps: int) -> Transformer:
    """`model` after `steps` AdamW steps of next-byte prediction on the standard library's source:
    enough to learn which bytes text is made of, so that what it streams is text."""
    data = _stdlib_bytes()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        starts = torch.randint(0, len(data) - 65, (8,), generator=gen)
        batch = torch.stack([data[i:i + 65] for i in starts.tolist()]).long()
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def _checkpoint(preset: str, root: Path) -> str:
    """A checkpoint of `preset` that writes text (see _writes_text), saved as training would save it."""
    cfg = build_config({"model": {"preset": preset}, "run": {"name": f"bench-{preset}", "dir": str(root / preset)}})
    torch.manual_seed(0)
    model = _writes_text(Transformer(cfg.model.args()), TEXT_STEPS[preset])
    files = {"config.yaml": to_yaml(cfg), "tokenizer.json": ByteTokenizer().to_json()}
    CheckpointManager(str(root / preset)).save(0, {"model": model.state_dict(), "optim": {}},
                                               {"step": 0, "world_size": 1}, {}, files)
    return str(root / preset)


def _plan(preset: str, quick: bool) -> tuple[tuple[int, ...], dict[int, int], tuple[int, int]]:
    """Concurrencies, requests per replay at each concurrency and output-length range for one model."""
    if quick:
        return CONCURRENCIES, {c: max(4, min(c, 16)) for c in CONCURRENCIES}, (8, 32)
    if preset == "tiny":
        # At 16, the cell the targets read, 3 rounds of 64 requests: one slow stretch of a shared host
        # moves one round's figures, and the interval over the rounds shows it (figures: docs/benchmarks.md).
        # 64 requests once at 64: no target reads that cell.
        return CONCURRENCIES, {1: 8, 4: 24, 16: 64, 64: 64}, (16, 192)
    # The small model decodes far slower; fewer, shorter requests bound the run's length (figures: docs/benchmarks.md).
    return CONCURRENCIES, {1: 2, 4: 4, 16: 10, 64: 12}, (16, 96)


def _rounds(preset: str, c: int, quick: bool) -> int:
    """Interleaved rounds at concurrency c: those of the targets' cell (tiny at 16), one replay per mode elsewhere."""
    if preset != "tiny" or c != TARGET_CONCURRENCY:
        return 1
    return 2 if quick else 3


def _round_order(i: int) -> tuple[str, ...]:
    """Round i's order of the modes: ROUND_ORDER, reversed every other round."""
    return ROUND_ORDER if i % 2 == 0 else ROUND_ORDER[::-1]


def _deploy_modes(run: str, preset: str, port: int, dtype: str, max_batch: int | None,
                  stream_interval_ms: float | None = None, modes: tuple[str, ...] = MODES) -> dict[str, str]:
    from ray import serve

    from cs3ray.serve.deploy import build_app, make_spec

    from .serve_batch import RequestBatchServer

    urls = {}
    for mode in modes:
        name = f"bench-{preset}-{mode}"
        spec = make_spec(run, name=name, route_prefix=f"/{name}",
                         overrides={"dtype": dtype, "max_batch": 1 if mode == "unbatched" else max_batch,
                                    "num_cpus": 1.0, "replicas": 1, "stream_interval_ms": stream_interval_ms})
        if mode == "serve_batch":
            app = RequestBatchServer.options(name=f"{name}-llm", max_ongoing_requests=1024,
                                             ray_actor_options=replica_actor_options({"num_cpus": 1.0})).bind(spec)
        else:
            spec.serve = spec.serve.model_copy(update={"max_ongoing_requests": 1024})
            app = build_app(spec)
        serve.run(app, name=name, route_prefix=spec.route_prefix, blocking=False)
        urls[mode] = f"http://127.0.0.1:{port}/{name}"
    return urls


def _per_round_ratio(ours: dict, theirs: dict) -> list[float]:
    """Per round, tokens/s of `ours` over `theirs` (a cell's replays are its rounds'); rounds either side of
    which delivered nothing are left out (their errors fail the benchmark anyway)."""
    if not ours or not theirs:
        return []
    return [round(a / b, 4) for a, b in zip(ours["replay_tokens_per_s"], theirs["replay_tokens_per_s"], strict=True)
            if a and b]


def _figure(name: str, rounds: list[float | None], difference: bool = False) -> dict:
    """`name` as the median of its rounds with a 95% interval; None (and a NaN interval) where none measured it."""
    kept = [x for x in rounds if x is not None and math.isfinite(x)]
    if not kept:
        return {name: None, f"{name}_interval": [math.nan, math.nan], f"{name}_rounds": []}
    return stats.summarize(name, kept, difference=difference)


def _summary(modes: dict[str, dict[str, dict]]) -> dict:
    """The targets' figures from the concurrency-16 cells, each over the interleaved rounds: continuous
    batching's tokens/s over each peer's in the same round, and continuous batching's p99 gap per round."""
    at16 = {m: modes[m].get(str(TARGET_CONCURRENCY), {}) for m in MODES}
    return {"modes": modes,
            **_figure("speedup_vs_unbatched_at_16", _per_round_ratio(at16["continuous"], at16["unbatched"])),
            **_figure("speedup_vs_serve_batch_at_16", _per_round_ratio(at16["continuous"], at16["serve_batch"])),
            **_figure("p99_itl_ms_at_16", at16["continuous"].get("replay_p99_itl_ms", []), difference=True)}


def judged(result: dict) -> dict:
    """The targets (tiny model at 16), their verdicts from the rounds' intervals, and the method."""
    return {"targets": TARGETS, "verdicts": stats.judge(result, TARGETS), "method": stats.METHOD}


INGRESS_CONCURRENCY = 16
INGRESS_REPLAYS = 2


def ingress_cost(run: str, latency_s: float, proxy_cell: dict, quick: bool, dtype: str, max_batch: int | None,
                 log: Callable[[str], None]) -> dict:
    """Continuous batching at concurrency 16 behind HAProxy on a cluster of its own (HAProxy is chosen when
    a cluster starts), the same workload as `proxy_cell`'s: both cells and the tokens/s ratio."""
    import os

    from ray import serve

    from cs3ray.ops.cluster_env import HAPROXY_ENV, HAPROXY_FILES, HAPROXY_SIDE_PORTS

    _, counts, out_range = _plan("tiny", quick)
    c = INGRESS_CONCURRENCY
    items = workload(counts[c], rate=c / latency_s, seed=c, output_tokens=out_range)
    saved = {k: os.environ.get(k) for k in (*HAPROXY_ENV, *HAPROXY_SIDE_PORTS, *HAPROXY_FILES)}
    os.environ.update(HAPROXY_ENV)
    port = free_port()
    try:
        with local_ray(max(8, os.cpu_count() or 1)):
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            try:
                url = _deploy_modes(run, "tiny", port, dtype, max_batch, modes=("continuous",))["continuous"]
                run_load(url, "bench-tiny-continuous", items[:1])  # warm-up
                cell = _clean(summarize([replay(url, "bench-tiny-continuous", items)
                                         for _ in range(INGRESS_REPLAYS)]))
            finally:
                serve.shutdown()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    ratio = round(cell["tokens_per_s"] / proxy_cell["tokens_per_s"], 3) if proxy_cell.get("tokens_per_s") else None
    log(f"tiny c={c} continuous behind HAProxy {cell['tokens_per_s']:8.0f} tok/s  itl p99 {cell['p99_itl_ms']:6.1f} ms"
        f"  ({ratio}x Serve's proxy)")
    return {"concurrency": c, "serve_proxy": proxy_cell, "haproxy": cell, "haproxy_vs_serve_proxy_tokens_per_s": ratio}


def _clean(cell: dict) -> dict:
    out = {k: (None if isinstance(cell[k], float) and math.isnan(cell[k]) else
               round(cell[k], 2) if isinstance(cell[k], float) else cell[k]) for k in CELL_KEYS}
    out["replay_tokens_per_s"] = [round(x, 2) for x in cell["replay_tokens_per_s"]]
    out["replay_p99_itl_ms"] = [None if math.isnan(x) else round(x, 2) for x in cell["replay_p99_itl_ms"]]
    out["first_error"] = cell["first_error"]  # a cell with failed requests fails the benchmark (report.measured)
    return out


def bench_model(run: str, preset: str, port: int, quick: bool, dtype: str, max_batch: int | None,
                log: Callable[[str], None]) -> dict:
    """All modes x concurrencies for one model; the result's shape is the JSON's."""
    from ray import serve

    concurrencies, counts, out_range = _plan(preset, quick)
    urls = _deploy_modes(run, preset, port, dtype, max_batch)
    try:
        # Little's law: the unloaded latency of a mean-length request turns concurrency into a rate.
        mean_out = sum(out_range) // 2
        probe = [Item(0.0, "def main(", mean_out, i) for i in range(1 if quick else 3)]
        run_load(urls["continuous"], f"bench-{preset}-continuous", probe[:1])  # warm-up
        t0 = time.perf_counter()
        for item in probe:
            run_load(urls["continuous"], f"bench-{preset}-continuous", [item])
        latency = (time.perf_counter() - t0) / len(probe)
        log(f"{preset}: unloaded latency of a {mean_out}-token request {latency * 1e3:.0f} ms")
        modes: dict[str, dict[str, dict]] = {m: {} for m in MODES}
        for c in concurrencies:
            items = workload(counts[c], rate=c / latency, seed=c, output_tokens=out_range)
            replays: dict[str, list[Replay]] = {m: [] for m in MODES}
            for i in range(_rounds(preset, c, quick)):
                for mode in _round_order(i):
                    replays[mode].append(replay(urls[mode], f"bench-{preset}-{mode}", items))
            for mode in MODES:
                cell = summarize(replays[mode])
                if cell["first_error"]:
                    log(f"  {mode} c={c}: {cell['errors']} errors, first: {cell['first_error']}")
                modes[mode][str(c)] = _clean(cell)
                log(f"{preset} c={c:>2} {mode:<11} {cell['tokens_per_s']:8.0f} tok/s  "
                    f"ttft p50 {cell['p50_ttft_ms']:7.1f} ms  p99 {cell['p99_ttft_ms']:7.1f} ms  "
                    f"itl p99 {cell['p99_itl_ms']:6.1f} ms  errors {cell['errors']}"
                    + ("" if len(replays[mode]) == 1 else
                       "  (rounds: " + ", ".join(f"{x:.0f}" for x in cell["replay_tokens_per_s"]) + " tok/s)"))
    finally:
        for mode in MODES:
            serve.delete(f"bench-{preset}-{mode}")
    return _summary(modes) | {"unloaded_latency_s": round(latency, 4), "rounds_at_16": _rounds(preset, TARGET_CONCURRENCY, quick)}


@contextlib.contextmanager
def local_ray(num_cpus: int) -> Iterator[None]:
    """A fresh Ray cluster of this process, even when another one runs on the machine.

    (address="local": a plain ray.init() would join any cluster already started here, and a
    benchmark must not share its CPUs with someone else's jobs.)
    """
    import ray

    export_cluster_env(serving=True)  # as `cs3 serve` runs its embedded cluster
    with watched_cluster():  # nothing of it outlives this process
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()


@contextlib.contextmanager
def peer_env(peer: str | None) -> Iterator[None]:
    """With a peer, vLLM's OpenMP threads bound to the peer's cores in every process of the cluster started
    inside (the serve.engine=vllm replica inherits it), as the standalone server's are."""
    import os

    if peer is None:
        yield
        return
    key, saved = "VLLM_CPU_OMP_THREADS_BIND", os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    os.environ[key] = ",".join(map(str, serve_peer.peer_cores()))
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = saved


def run(quick: bool = False, small: bool | None = None, dtype: str = "auto", max_batch: int | None = None,
        peer: str | None = None, vllm_eager: bool | None = None, log: Callable[[str], None] = print) -> dict:
    """The whole benchmark on an embedded Ray cluster; tiny at the top level, small under models.small.

    max_batch None keeps the serve config's default (serve.max_batch): under overload a bigger
    running batch buys little throughput and stretches every inter-token gap.
    peer "vllm": the tiny model also against vLLM standalone and serve.engine=vllm (serve_peer), under `peer`;
    vllm_eager is serve.eager of both vLLM sides (None: eager on CPUs).
    """
    import os

    from ray import serve

    inference_dtype(dtype, "cpu")  # an unknown precision is refused before a cluster starts
    serve_peer.require_peer(peer)  # and a peer that is not installed
    small = (not quick) if small is None else small
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="cs3-bench-serve-") as tmp, peer_env(peer):
        tiny = _checkpoint("tiny", Path(tmp))
        with local_ray(max(8, os.cpu_count() or 1)):
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            ingress = "haproxy" if os.environ.get(HAPROXY_SWITCH) == "1" else "serve proxy"
            log(f"ingress: {ingress}")
            try:
                result = bench_model(tiny, "tiny", port, quick, dtype, max_batch, log)
                result |= judged(result)
                if peer:
                    result["peer"] = serve_peer.bench_peer(
                        tiny, port, result["unloaded_latency_s"], _plan("tiny", quick),
                        lambda c: serve_peer.peer_rounds(c, quick, _rounds("tiny", c, quick)), dtype, max_batch,
                        _clean, Path(tmp), log, eager=vllm_eager)
                    result = serve_peer.judged(result)
                if small:
                    result["models"] = {"small": bench_model(_checkpoint("small", Path(tmp)), "small", port, quick,
                                                             dtype, max_batch, log)}
                result["ingress"] = ingress
                result["dtype"] = resolve_precision(dtype, "cpu")
            finally:
                serve.shutdown()
        if ingress == "serve proxy" and haproxy_binary():  # what the opt-in HAProxy would change
            proxy_cell = result["modes"]["continuous"].get(str(INGRESS_CONCURRENCY), {})
            result["ingress_cost"] = ingress_cost(tiny, result["unloaded_latency_s"], proxy_cell, quick, dtype,
                                                  max_batch, log)
    return result



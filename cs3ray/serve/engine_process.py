"""The engine in a process of its own, driven from a replica like an in-process Engine.

In one process the engine thread shares the GIL with Serve's asyncio threads, which format
and send every streamed chunk: a torch op releases the GIL and the engine must win it back
after each of the ~100 ops of a decode step, so a streaming replica decoded at a fraction of the
engine's own rate (figures: docs/benchmarks.md). vLLM runs its engine core in a separate process
for the same reason. Here the child runs the engine loop on its main thread with nothing to
compete with; the replica sends requests, cancellations and new weights through a pipe and gets
each step's events back as one message.
"""

from __future__ import annotations

import io
import logging
import multiprocessing as mp
import threading
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection
from typing import Any

import torch

from cs3ray.models import ModelArgs, Transformer

from .engine import Engine, EngineOptions, Metrics, NoMetrics, QueueFull
from .sequence import Event, GenRequest

log = logging.getLogger(__name__)


def _weights(model: Transformer) -> tuple[ModelArgs, bytes, torch.dtype]:
    """What the child needs to rebuild `model`: its shape, its tensors (as bytes) and dtype."""
    buf = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buf)
    return model.args, buf.getvalue(), next(model.parameters()).dtype


def _model(args: ModelArgs, blob: bytes, dtype: torch.dtype, device: str) -> Transformer:
    model = Transformer(args).to(dtype)
    model.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    return model.to(device).eval()


@dataclass
class _Recorder:
    """Metrics recorded in the child and replayed by the replica (Ray's metrics live there)."""

    ttft: list[float]
    itl: list[float]
    tokens: int = 0
    queue: tuple[int, int] = (0, 0)

    def take(self) -> "_Recorder":
        out = replace(self, ttft=self.ttft, itl=self.itl)
        self.ttft, self.itl, self.tokens = [], [], 0
        return out


class _ChildMetrics:
    def __init__(self) -> None:
        self.rec = _Recorder([], [])

    def ttft(self, seconds: float) -> None:
        self.rec.ttft.append(seconds)

    def itl(self, seconds: float) -> None:
        self.rec.itl.append(seconds)

    def queue(self, waiting: int, running: int) -> None:
        self.rec.queue = (waiting, running)

    def tokens(self, n: int) -> None:
        self.rec.tokens += n


def _child(conn: Connection, weights: tuple[ModelArgs, bytes, torch.dtype], device: str, eos_id: int,
           options: EngineOptions, token_bytes: list[bytes] | None = None) -> None:
    """The engine process: apply what the replica sent, run a step, send the step's events."""
    torch.set_num_threads(max(1, options.threads or 1))
    metrics = _ChildMetrics()
    engine = Engine(_model(*weights, device), eos_id, options, metrics, token_bytes)
    requests: dict[int, GenRequest] = {}
    outbox: list[tuple[int, Event]] = []

    def emitter(rid: int):
        return lambda ev: outbox.append((rid, ev))

    def apply(msg: tuple) -> bool:
        kind = msg[0]
        if kind == "submit":
            _, rid, req = msg
            req.emit = emitter(rid)
            requests[rid] = req
            engine.submit(req)
        elif kind == "cancel" and msg[1] in requests:
            engine.cancel(requests[msg[1]])
        elif kind == "swap":
            engine.swap_model(_model(*msg[1], device))
        elif kind == "stop":
            return False
        return True

    running = True
    while running:
        try:
            # Block for the next message only when there is nothing to decode.
            wait = None if engine.idle() else 0
            while running and conn.poll(wait):
                running = apply(conn.recv())
                wait = 0
        except (EOFError, OSError):
            running = False  # the replica is gone
        if running and not engine.idle():
            engine.run_step()
        elif not running:
            engine.fail_all("server is shutting down")
        for rid, ev in outbox:
            if ev.finish_reason is not None:
                requests.pop(rid, None)
        if outbox or metrics.rec.ttft or metrics.rec.itl or not running:
            try:
                conn.send(("events", outbox, metrics.rec.take(), engine.load()))
            except (BrokenPipeError, OSError):
                return
            outbox = []


class EngineProcess:
    """An Engine in a child process with the in-process Engine's interface (submit, cancel,
    swap_model, stop, load). Events come back on a reader thread and go to each request's emit."""

    def __init__(self, model: Transformer, eos_id: int, options: EngineOptions = EngineOptions(),
                 metrics: Metrics | None = None, token_bytes: list[bytes] | None = None) -> None:
        self.args = model.args
        self.options = options
        self.metrics = metrics or NoMetrics()
        device = str(next(model.parameters()).device)
        # spawn: forking a process that runs Ray's and Serve's threads could copy a held lock.
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe()
        # The child keeps the engine's waiting queue unbounded: the limit is enforced here, at submit.
        child_options = replace(options, max_waiting=1 << 30)
        self._proc = ctx.Process(target=_child, name="cs3-engine", daemon=True,
                                 args=(child_end, _weights(model), device, eos_id, child_options, token_bytes))
        self._proc.start()
        child_end.close()
        self._send_lock = threading.Lock()
        self._lock = threading.Lock()
        self._requests: dict[int, GenRequest] = {}
        self._next_id = 0
        self._load = {"running": 0, "waiting": 0, "slots": options.max_batch, "steps": 0, "busy_s": 0.0, "cpu_s": 0.0}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read, name="cs3-engine-events", daemon=True)
        self._reader.start()

    # --- the Engine interface --------------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        with self._lock:
            if self._dead:
                raise QueueFull(f"the engine process has stopped ({self._dead})")
            waiting = self._waiting()
            if waiting >= self.options.max_waiting:
                raise QueueFull(f"{waiting} requests are already waiting")
            rid, self._next_id = self._next_id, self._next_id + 1
            self._requests[rid] = req
            req._cs3_rid = rid  # type: ignore[attr-defined]  # cancel() finds the child's copy by it
        self._send(("submit", rid, replace(req, emit=None)))  # the callback stays here; the child makes its own

    def cancel(self, req: GenRequest) -> None:
        rid = getattr(req, "_cs3_rid", None)
        if rid is not None:
            self._send(("cancel", rid))

    def swap_model(self, model: Transformer) -> None:
        if model.args != self.args:
            raise ValueError("the new checkpoint has a different model shape; restart the server to change it")
        self._send(("swap", _weights(model)))

    def stop(self, timeout: float = 10.0) -> None:
        self._send(("stop",))
        self._proc.join(timeout)
        if self._proc.is_alive():
            self._proc.kill()

    def load(self) -> dict[str, Any]:
        """Running and waiting sequences, steps taken, busy and CPU seconds (as of the last step)."""
        with self._lock:
            return {**self._load, "waiting": self._waiting()}

    def _waiting(self) -> int:
        # Requests the child has not finished, beyond its KV cache slots, wait (the child's own
        # count lags by a step, and a burst of submits must see the limit at once).
        return max(0, len(self._requests) - self._load["slots"])

    def alive(self) -> bool:
        return self._dead is None and self._proc.is_alive()

    # --- plumbing ----------------------------------------------------------------------------
    def _send(self, msg: tuple) -> None:
        try:
            with self._send_lock:
                self._conn.send(msg)
        except (BrokenPipeError, OSError) as exc:
            self._died(f"{type(exc).__name__}")

    def _read(self) -> None:
        while True:
            try:
                _, events, rec, load = self._conn.recv()
            except (EOFError, OSError):
                self._died(f"exit code {self._proc.exitcode}" if self._proc.exitcode is not None else "pipe closed")
                return
            with self._lock:
                self._load = load
                reqs = [(self._requests.get(rid), ev) for rid, ev in events]
                for rid, ev in events:
                    if ev.finish_reason is not None:
                        self._requests.pop(rid, None)
            for req, ev in reqs:
                if req is not None:
                    req.emit(ev)
            for s in rec.ttft:
                self.metrics.ttft(s)
            for s in rec.itl:
                self.metrics.itl(s)
            if rec.tokens:
                self.metrics.tokens(rec.tokens)
            self.metrics.queue(*rec.queue)

    def _died(self, why: str) -> None:
        """The child is gone: every open request ends with an error instead of waiting forever."""
        with self._lock:
            if self._dead is not None:
                return
            self._dead = why
            orphans, self._requests = list(self._requests.values()), {}
        if orphans:
            log.error("the engine process stopped (%s); failing %d requests", why, len(orphans))
        for req in orphans:
            req.emit(Event("", "error", len(req.prompt_ids), error=f"the engine process stopped ({why})"))


"""Iteration-level continuous batching (as in Orca / vLLM) for one replica.

Every step: admit waiting requests while the KV budget allows, then run one forward that
prefills them and decodes a token for every running sequence together. Sequences join and
leave between steps, so a short request never waits for a long one, unlike request-level batching.
The engine is plain Python + torch (no Ray): a thread runs `loop()`, callers `submit()`.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from cs3ray.models import Transformer

from .forward import Decode, Prefill, pack, ragged_forward
from .kv import SlotCache
from .sequence import Event, GenRequest, Sequence

log = logging.getLogger(__name__)


class Metrics(Protocol):
    """Where the engine reports latency and load (Ray metrics in a replica, nothing in tests)."""

    def ttft(self, seconds: float) -> None: ...
    def itl(self, seconds: float) -> None: ...
    def queue(self, waiting: int, running: int) -> None: ...
    def tokens(self, n: int) -> None: ...


class NoMetrics:
    """Metrics that go nowhere (tests, benchmarks' peers)."""

    def ttft(self, seconds: float) -> None: pass
    def itl(self, seconds: float) -> None: pass
    def queue(self, waiting: int, running: int) -> None: pass
    def tokens(self, n: int) -> None: pass


@dataclass(frozen=True)
class EngineOptions:
    max_batch: int = 16  # sequences decoded together; 1 means no batching (serve.max_batch sets it)
    kv_cache_mb: float = 256.0  # memory budget of the KV cache
    max_prefill_tokens: int = 256  # prompt tokens prefilled per step, so decodes are not starved
    max_waiting: int = 1024  # queued requests beyond this are refused
    threads: int | None = None  # torch threads of the engine thread (None: leave torch's default)


def filtered(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """One row of probabilities restricted to its top_k tokens, then to the smallest set
    holding top_p of the remaining mass (the first token always stays); not renormalised."""
    if top_k > 0:
        kth = torch.topk(probs, min(top_k, probs.shape[-1])).values[-1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_p, idx = (probs / probs.sum()).sort(descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        probs = probs.scatter(-1, idx[drop], 0.0)
    return probs


class QueueFull(Exception):
    """The engine's waiting queue is at its limit; the caller should answer 503."""


class Engine:
    """Continuous-batching generation over one model; thread-safe submit/cancel."""

    def __init__(self, model: Transformer, eos_id: int, options: EngineOptions = EngineOptions(),
                 metrics: Metrics | None = None, token_bytes: list[bytes] | None = None) -> None:
        self.model = pack(model)
        self.eos_id = eos_id
        self.token_bytes = token_bytes  # the tokenizer's bytes per id (None: the byte tokenizer)
        self.options = options
        self.metrics = metrics or NoMetrics()
        param = next(model.parameters())
        self.cache = SlotCache.for_budget(model.args, options.max_batch, int(options.kv_cache_mb * 2**20),
                                          param.dtype, param.device)
        self.waiting: collections.deque[GenRequest] = collections.deque()
        self.running: list[Sequence] = []
        self._lock = threading.Condition()
        self._cancelled: set[int] = set()
        self._next_model: Transformer | None = None
        self._stop = False
        self._last_token_at: dict[int, float] = {}
        self.steps = 0
        self.busy_s = 0.0  # time spent in step(): with wall time, how loaded the replica is
        self.cpu_s = 0.0  # CPU time of those steps: below busy_s when other processes take the cores

    # --- called from other threads -------------------------------------------------------
    def submit(self, req: GenRequest) -> None:
        """Queue a request; its events arrive through req.emit from the engine thread."""
        with self._lock:
            if len(self.waiting) >= self.options.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(req)
            self._lock.notify()

    def cancel(self, req: GenRequest) -> None:
        """Stop a request (client gone or timed out); its slot is freed at the next step."""
        with self._lock:
            self._cancelled.add(id(req))
            self._lock.notify()

    def swap_model(self, model: Transformer) -> None:
        """Use new weights from the next step on; running sequences continue, none is dropped."""
        if model.args != self.model.args:
            raise ValueError("the new checkpoint has a different model shape; restart the server to change it")
        pack(model)  # in the caller's thread: the engine thread only switches
        with self._lock:
            self._next_model = model
            self._lock.notify()

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._lock.notify()

    def loop(self) -> None:
        """Run steps until stop(); sleeps while there is nothing to do."""
        if self.options.threads:
            # OpenMP's thread count is per thread: one set in the constructor's thread does not
            # reach this one, which would otherwise spin up a thread per core on a shared CPU.
            torch.set_num_threads(self.options.threads)
        while True:
            with self._lock:
                while not (self._stop or self.waiting or self.running or self._next_model):
                    self._lock.wait()
                if self._stop:
                    break
            self.run_step()
        self.fail_all("server is shutting down")

    def idle(self) -> bool:
        """Nothing to decode, admit or swap in."""
        with self._lock:
            return not (self.waiting or self.running or self._next_model)

    def run_step(self) -> None:
        """One step; an engine bug fails the requests in flight instead of hanging them."""
        try:
            self.step()
        except Exception as exc:  # noqa: BLE001
            log.exception("engine step failed")
            self.fail_all(f"internal engine error: {type(exc).__name__}")

    def load(self) -> dict:
        """Running and waiting sequences, KV cache slots, steps taken, and the time (wall, CPU) spent in steps."""
        return {"running": len(self.running), "waiting": len(self.waiting), "slots": self.cache.slots, "steps": self.steps,
                "busy_s": self.busy_s, "cpu_s": self.cpu_s}

    # --- the engine thread -----------------------------------------------------------------
    def step(self) -> None:
        """One iteration: apply a pending model swap, drop cancelled, admit + prefill, decode."""
        t0, c0 = time.perf_counter(), time.thread_time()
        with self._lock:
            if self._next_model is not None:
                self.model, self._next_model = self._next_model, None
            cancelled, self._cancelled = self._cancelled, set()
            dropped = [r for r in self.waiting if id(r) in cancelled]
            if dropped:  # anywhere in the queue, so a client that gave up costs no compute later
                self.waiting = collections.deque(r for r in self.waiting if id(r) not in cancelled)
            admitted = self._admit()
        for req in dropped:
            req.emit(Event("", "cancelled", len(req.prompt_ids)))
        for seq in [s for s in self.running if id(s.req) in cancelled]:
            self._finish(seq, "cancelled")
        decoding = [s for s in self.running if s.pending is not None and s not in admitted]
        if decoding or admitted:
            self._forward(decoding, admitted)
        self.steps += 1
        self.metrics.queue(len(self.waiting), len(self.running))
        self.busy_s += time.perf_counter() - t0
        self.cpu_s += time.thread_time() - c0

    def _admit(self) -> list[Sequence]:
        admitted, prefill = [], 0
        while self.waiting:
            req = self.waiting[0]
            if not self.cache.free_slots or (admitted and prefill + len(req.prompt_ids) > self.options.max_prefill_tokens):
                break
            self.waiting.popleft()
            seq = Sequence(req, self.cache.allocate(), self.eos_id, self.token_bytes)
            prefill += len(req.prompt_ids)
            self.running.append(seq)
            admitted.append(seq)
        return admitted

    def _forward(self, decoding: list[Sequence], admitted: list[Sequence]) -> None:
        """One forward for the step: a token for each running sequence, and the admitted prompts."""
        device = self.cache.k.device
        decode = prefill = None
        if decoding:
            decoding.sort(key=lambda s: s.slot)  # consecutive slots let the cache hand out views
            decode = Decode(torch.tensor([s.pending for s in decoding], device=device),
                            torch.tensor([s.position for s in decoding], device=device),
                            torch.tensor([s.slot for s in decoding], device=device))
        if admitted:
            lengths = [len(s.req.prompt_ids) for s in admitted]
            t = max(lengths)
            prefill = Prefill(torch.tensor([s.req.prompt_ids + [0] * (t - n) for s, n in zip(admitted, lengths, strict=True)],
                                           device=device),
                              torch.tensor(lengths, device=device),
                              torch.tensor([s.slot for s in admitted], device=device))
        logits = ragged_forward(self.model, self.cache, decode, prefill)
        now = time.perf_counter()
        for s in decoding:
            s.position += 1
            self.metrics.itl(now - self._last_token_at.get(id(s), now))
            self._last_token_at[id(s)] = now
        for s in admitted:
            s.position = len(s.req.prompt_ids)
            self.metrics.ttft(now - s.req.arrived)
            self._last_token_at[id(s)] = now
        self._sample(decoding + admitted, logits)

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        picks = [0] * len(seqs)
        greedy = [i for i, s in enumerate(seqs) if s.req.params.temperature <= 0]
        drawn = [i for i, s in enumerate(seqs) if s.req.params.temperature > 0]
        if greedy:  # one argmax over all greedy rows
            for i, tok in zip(greedy, logits[greedy].float().argmax(-1).tolist(), strict=True):
                picks[i] = tok
        if drawn:
            temps = torch.tensor([seqs[i].req.params.temperature for i in drawn], device=logits.device)
            probs = torch.softmax(logits[drawn].float() / temps.unsqueeze(1), dim=-1)
            for row, i in enumerate(drawn):
                params = seqs[i].req.params
                if params.top_k > 0 or params.top_p < 1.0:  # per-row filters (their params differ)
                    probs[row] = filtered(probs[row], params.top_k, params.top_p)
            # Inverse-CDF sampling, all rows at once: each row's uniform draw comes from its own
            # request's generator, so a seeded request samples the same tokens whoever else is in
            # the batch (and costs no per-row torch call).
            cdf = probs.cumsum(-1)
            u = torch.tensor([seqs[i].rng.random() for i in drawn], device=cdf.device).unsqueeze(1) * cdf[:, -1:]
            tokens = torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=cdf.shape[-1] - 1)
            for i, tok in zip(drawn, tokens.tolist(), strict=True):
                picks[i] = tok
        self.metrics.tokens(len(seqs))
        for s, tok in zip(seqs, picks, strict=True):
            s.pending = None
            s.accept(tok)
            if s.finished:
                self._finish(s, s.finished)
            else:
                text = s.flush()
                if text:
                    s.req.emit(Event(text))

    def _finish(self, seq: Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.cache.release(seq.slot)
        self._last_token_at.pop(id(seq), None)
        self._compact(seq.slot)
        seq.finished = seq.finished or reason
        text = seq.flush() if reason != "cancelled" else ""
        seq.req.emit(Event(text, reason, len(seq.req.prompt_ids), seq.generated))

    def _compact(self, hole: int) -> None:
        """Move the highest running sequence into a freed lower slot, keeping slots consecutive."""
        top = max(self.running, key=lambda s: s.slot, default=None)
        if top is not None and top.slot > hole:
            self.cache.relocate(top.slot, hole, top.position)
            top.slot = hole

    def fail_all(self, message: str) -> None:
        with self._lock:
            waiting, self.waiting = list(self.waiting), collections.deque()
        for req in waiting:
            req.emit(Event("", "error", len(req.prompt_ids), error=message))
        for seq in list(self.running):
            self.running.remove(seq)
            self.cache.release(seq.slot)
            seq.req.emit(Event("", "error", len(seq.req.prompt_ids), seq.generated, error=message))

"""The Ray Serve application: an OpenAI-compatible FastAPI ingress over the batching engine.

One replica = one engine process (engine_process) holding the model. Requests are validated,
tokenized and queued in the engine; text comes back through an asyncio queue and is returned whole or
streamed as server-sent events. Client mistakes are 4xx with an OpenAI-style error body.
"""

# No `from __future__ import annotations` here: Serve's ingress rebuilds the route signatures,
# and FastAPI must see real classes (a string "Request" would become a required query field).
import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from cs3ray.ckpt import load_for_inference
from cs3ray.ops.json_logs import replica_logs, run_log, set_step

from .auth import check_bearer
from .engine import EngineOptions, Metrics, QueueFull
from .engine_process import EngineProcess
from .follow import Follower
from .metrics import RayMetrics
from .pump import EventPump
from .schemas import (
    TURN,
    APIError,
    ChatRequest,
    CompletionRequest,
    chat_body,
    chat_prompt,
    check_prompt_chars,
    completion_body,
    decode_json,
    new_id,
    parse,
    prompt_char_limit,
    prompt_ids,
    usage,
)
from .sequence import Event, GenRequest
from .spec import ServeSpec
from .tuning import tune_replica_process

log = logging.getLogger(__name__)
# Far above any prompt that fits a context window; bounds what a client can make a replica buffer.
MAX_BODY_BYTES = 4 << 20
# No docs pages, and the OpenAPI document only as a route of the class below, behind the token.
api = FastAPI(title="cs3ray", docs_url=None, redoc_url=None, openapi_url=None)


@api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@api.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    # Unknown routes and wrong methods answer in the API's error shape too.
    return JSONResponse(APIError(exc.status_code, str(exc.detail), code="not_found" if exc.status_code == 404
                                 else None).body(), exc.status_code)


@api.exception_handler(Exception)
async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
    # A bug must still answer in the API's shape (and is logged with its traceback).
    log.exception("unexpected error")
    return JSONResponse(APIError(500, f"internal error: {type(exc).__name__}", "server_error").body(), 500)


async def read_json(request: Request) -> Any:
    """The request's JSON body, read up to MAX_BODY_BYTES (a larger body is a 413, never buffered)."""
    body = bytearray()
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"the request body exceeds {MAX_BODY_BYTES >> 20} MiB", code="body_too_large")
    return decode_json(bytes(body))


def load_replica(spec: ServeSpec, device: str):
    """A replica's first steps: torch's threads from its CPU share, then the checkpoint on `device`."""
    torch.set_num_threads(spec.serve.torch_threads())
    loaded = load_for_inference(spec.run, spec.storage_options, dtype=spec.dtype(device), trust_code=spec.trust_code,
                                replicas=spec.ckpt_replicas, stored_replicas=spec.stored_replicas)
    loaded.model.to(device)
    return loaded


def start_engine(model: torch.nn.Module, eos_id: int, options: EngineOptions,
                 metrics: Metrics | None = None, token_bytes: list[bytes] | None = None) -> EngineProcess:
    """The replica's engine, in a process of its own (see engine_process: no GIL shared with Serve)."""
    return EngineProcess(model, eos_id, options, metrics, token_bytes)


def sse(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body)}\n\n"


@serve.deployment
@serve.ingress(api)
class LLMServer:
    """One replica: loads the checkpoint, starts the engine process, answers the OpenAI routes."""

    def __init__(self, spec: ServeSpec) -> None:
        self.spec = spec
        if spec.log_format == "json":
            replica_logs(spec.run_name or spec.name, 0)
        if spec.serve.engine == "vllm":
            self._start_vllm(spec)
            return
        device = "cuda" if spec.serve.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.dtype = spec.dtype(device)
        loaded = load_replica(spec, device)
        self.tokenizer = loaded.tokenizer
        self.context = loaded.model.args.max_seq_len
        self.max_prompt_chars = spec.serve.max_prompt_chars or prompt_char_limit(self.context,
                                                                                 loaded.tokenizer.token_bytes())
        self.fingerprint = f"step-{loaded.step}"
        set_step(loaded.step)
        run_log.info("replica serves step %d as '%s' (%s on %s)", loaded.step, spec.name,
                     str(self.dtype).removeprefix("torch."), device)
        self.engine = start_engine(loaded.model, loaded.tokenizer.eos_id, spec.engine_options(), RayMetrics(),
                                   loaded.tokenizer.token_bytes())
        self.follower = (Follower(spec, loaded.url, self._swap, device, self.dtype, loaded.tokenizer)
                         if spec.follow else None)
        del loaded  # the engine process has its own copy of the weights
        self.created = int(time.time())
        self._pump: EventPump | None = None
        self.pacer = spec.pacer()
        tune_replica_process()

    def _start_vllm(self, spec: ServeSpec) -> None:
        """serve.engine=vllm: vLLM over the checkpoint's HF export, behind the same routes (vllm_replica)."""
        from .vllm_replica import VLLMFollower, start_vllm

        replica = start_vllm(spec, RayMetrics())
        self.dtype = replica.engine.dtype  # what vLLM runs, not only what was asked
        self.tokenizer, self.context, self.engine = replica.tokenizer, replica.context, replica.engine
        self.max_prompt_chars = spec.serve.max_prompt_chars or prompt_char_limit(self.context,
                                                                                 self.tokenizer.token_bytes())
        self.fingerprint = f"step-{replica.export.step}"
        set_step(replica.export.step)
        self.follower = VLLMFollower(spec, replica, self._switched) if spec.follow else None
        self.created = int(time.time())
        self._pump = None
        self.pacer = spec.pacer()

    def _switched(self, step: int | None) -> None:
        self.fingerprint = f"step-{step}"
        set_step(step)
        run_log.info("replica now serves step %s", step)

    def _swap(self, model: torch.nn.Module, step: int) -> None:
        self.engine.swap_model(model)
        self.fingerprint = f"step-{step}"
        set_step(step)
        run_log.info("replica now serves step %d", step)

    def __del__(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.engine.stop()

    # --- routes ----------------------------------------------------------------------------
    @api.get("/healthz")
    async def healthz(self) -> dict:
        if not self.engine.alive():
            raise APIError(503, "the engine process has stopped", "server_error")
        load = self.engine.load()
        return {"status": "ok", "checkpoint": self.fingerprint, "dtype": str(self.dtype).removeprefix("torch."),
                "running": load["running"], "waiting": load["waiting"], "steps": load["steps"],
                "busy_s": round(load["busy_s"], 3), "cpu_s": round(load["cpu_s"], 3)}

    @api.get("/openapi.json", include_in_schema=False)
    async def openapi(self, request: Request) -> JSONResponse:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        return JSONResponse(request.app.openapi())

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": self.spec.name, "object": "model", "created": self.created,
                                            "owned_by": "cs3ray"}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        gen = await self._request(req, req.text(), req.stop_list(), "prompt")
        rid = new_id("cmpl")

        def body(text: str, finish: str | None, chunk: bool, use: dict | None = None, first: bool = False) -> dict:
            return completion_body(rid, req.model, self.fingerprint, text, finish, chunk, use)
        return await self._respond(req, gen, body)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        req: ChatRequest = parse(ChatRequest, await read_json(request))
        gen = await self._request(req, chat_prompt(req.messages), req.stop_list() + (TURN,), "messages")
        rid = new_id("chatcmpl")

        def body(text: str | None, finish: str | None, chunk: bool, use: dict | None = None,
                 first: bool = False) -> dict:
            return chat_body(rid, req.model, self.fingerprint, text, finish, chunk, use, first)
        return await self._respond(req, gen, body)

    # --- plumbing --------------------------------------------------------------------------
    async def _request(self, req: "CompletionRequest | ChatRequest", text: str, stop: tuple[str, ...],
                       param: str) -> GenRequest:
        if req.model != self.spec.name:
            raise APIError(404, f"model '{req.model}' is not served here; this server has '{self.spec.name}' "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        check_prompt_chars(text, self.max_prompt_chars, self.context, param)
        # In a worker thread: the routes share Serve's main event loop, which a long prompt must not stall.
        ids = await asyncio.to_thread(prompt_ids, self.tokenizer, text)
        return GenRequest(ids, req.sampling(len(ids), self.context), stop, ignore_eos=req.ignore_eos)

    async def _events(self, gen: GenRequest, paced: bool) -> AsyncIterator[Event]:
        """Engine events for one request; a paced stream gets what piled up since its last chunk as one."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event | None] = asyncio.Queue()
        if self._pump is None:  # the replica's event loop exists only once requests arrive
            self._pump = EventPump(loop)
        gen.emit = self._pump.emitter(queue.put_nowait)
        try:
            self.engine.submit(gen)
        except QueueFull as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later", "server_error", code="overloaded") from None
        timeout_s = self.spec.serve.request_timeout_s
        timer = loop.call_later(timeout_s, queue.put_nowait, None)  # None in the queue: time is up
        pacer = self.pacer if paced else None
        done, sending, last_sent = False, False, 0.0
        try:
            while not done:
                ev = await queue.get()
                if pacer and not sending:  # a stream counts once it runs (queued ones send nothing)
                    pacer.active += 1
                    sending = True
                if pacer and ev is not None and ev.finish_reason is None:
                    wait = last_sent + pacer.interval() - loop.time()
                    if wait > 0:
                        await asyncio.sleep(wait)
                while ev is not None and ev.finish_reason is None and not queue.empty():
                    nxt = queue.get_nowait()
                    ev = nxt and Event(ev.text + nxt.text, nxt.finish_reason, nxt.prompt_tokens,
                                       nxt.completion_tokens, nxt.error)
                if ev is None:
                    raise APIError(408, f"the request ran longer than {timeout_s:g} s and was cancelled; "
                                        "ask for fewer max_tokens", code="timeout")
                done = ev.finish_reason is not None
                if ev.finish_reason == "error":
                    raise APIError(503, ev.error or "generation failed", "server_error")
                last_sent = loop.time()
                yield ev
        finally:
            timer.cancel()
            if sending:
                pacer.active -= 1
            if not done:  # the client went away or timed out: free the slot
                self.engine.cancel(gen)

    async def _respond(self, req: "CompletionRequest | ChatRequest", gen: GenRequest, body) -> Any:
        events = self._events(gen, paced=req.stream)
        if not req.stream:
            parts, last = [], None
            async for ev in events:
                parts.append(ev.text)
                last = ev
            return body("".join(parts), last.finish_reason, False, usage(last.prompt_tokens, last.completion_tokens))
        # Fail before the 200 is sent if the request cannot even be queued.
        first = await anext(events)
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        async def stream() -> AsyncIterator[str]:
            ev, is_first = first, True
            try:
                while True:
                    yield sse(body(ev.text, ev.finish_reason, True, first=is_first))
                    is_first = False
                    if ev.finish_reason is not None:
                        break
                    ev = await anext(events)
                if include_usage:
                    yield sse(body(None, None, True, usage(ev.prompt_tokens, ev.completion_tokens)))
            except APIError as exc:  # mid-stream the status is already 200: send the error as an event
                yield sse(exc.body())
            finally:
                await events.aclose()
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

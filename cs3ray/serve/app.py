"""The Ray Serve application: an OpenAI-compatible FastAPI ingress over the batching engine.

One replica = one model copy + one engine thread. Requests are validated, tokenized and
queued in the engine; text comes back through an asyncio queue and is returned whole or
streamed as server-sent events. Client mistakes are 4xx with an OpenAI-style error body.
"""

# No `from __future__ import annotations` here: Serve's ingress rebuilds the route signatures,
# and FastAPI must see real classes (a string "Request" would become a required query field).
import asyncio
import gc
import json
import logging
import threading
import time
from typing import Any, AsyncIterator

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from ray import serve

from cs3ray.ckpt import load_for_inference

from .auth import check_bearer
from .engine import Engine, QueueFull
from .follow import Follower
from .metrics import RayMetrics
from .pump import EventPump
from .schemas import (TURN, APIError, ChatRequest, CompletionRequest, chat_body, chat_prompt, completion_body,
                      new_id, parse, prompt_ids, usage)
from .sequence import Event, GenRequest
from .spec import ServeSpec

log = logging.getLogger(__name__)
# Far above any prompt that fits a context window; bounds what a client can make a replica buffer.
MAX_BODY_BYTES = 4 << 20
api = FastAPI(title="cs3ray", docs_url=None, redoc_url=None)


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
    try:
        return json.loads(bytes(body))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None


def freeze_heap() -> None:
    """Exempt everything loaded so far (Ray, torch, the model) from the garbage collector's scans.

    A full collection walks every live object: in a replica that is millions of objects and
    stalls every stream for a long moment; frozen, it only walks what requests allocated.
    """
    gc.collect()
    gc.freeze()


def sse(body: dict) -> str:
    """One server-sent event carrying a JSON body."""
    return f"data: {json.dumps(body)}\n\n"


@serve.deployment
@serve.ingress(api)
class LLMServer:
    """One replica: loads the checkpoint, runs the engine thread, answers the OpenAI routes."""

    def __init__(self, spec: ServeSpec) -> None:
        self.spec = spec
        torch.set_num_threads(max(1, int(spec.serve.num_cpus)))
        device = "cuda" if spec.serve.num_gpus > 0 and torch.cuda.is_available() else "cpu"
        self.dtype = spec.dtype(device)
        loaded = load_for_inference(spec.run, spec.storage_options, dtype=self.dtype)
        loaded.model.to(device)
        self.tokenizer = loaded.tokenizer
        self.context = loaded.model.args.max_seq_len
        self.fingerprint = f"step-{loaded.step}"
        self.engine = Engine(loaded.model, loaded.tokenizer.eos_id, spec.engine_options(), RayMetrics())
        self._thread = threading.Thread(target=self.engine.loop, name="cs3-engine", daemon=True)
        self._thread.start()
        self.follower = Follower(spec, loaded.url, self._swap, device, self.dtype) if spec.follow else None
        self.created = int(time.time())
        self._pump: EventPump | None = None
        freeze_heap()


    def _swap(self, model: torch.nn.Module, step: int) -> None:
        self.engine.swap_model(model)
        self.fingerprint = f"step-{step}"

    def __del__(self) -> None:
        if self.follower is not None:
            self.follower.stop()
        self.engine.stop()

    # --- routes ----------------------------------------------------------------------------
    @api.get("/healthz")
    async def healthz(self) -> dict:
        alive = self._thread.is_alive()
        if not alive:
            raise APIError(503, "the engine thread has stopped", "server_error")
        return {"status": "ok", "checkpoint": self.fingerprint, "running": len(self.engine.running),
                "waiting": len(self.engine.waiting), "steps": self.engine.steps,
                "busy_s": round(self.engine.busy_s, 3), "cpu_s": round(self.engine.cpu_s, 3)}

    @api.get("/v1/models")
    async def models(self, request: Request) -> dict:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        return {"object": "list", "data": [{"id": self.spec.name, "object": "model", "created": self.created,
                                            "owned_by": "cs3ray"}]}

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        req: CompletionRequest = parse(CompletionRequest, await read_json(request))
        gen = self._request(req, req.text(), req.stop_list())
        rid = new_id("cmpl")

        def body(text: str, finish: str | None, chunk: bool, use: dict | None = None, first: bool = False) -> dict:
            return completion_body(rid, req.model, self.fingerprint, text, finish, chunk, use)
        return await self._respond(req, gen, body)

    @api.post("/v1/chat/completions")
    async def chat(self, request: Request) -> Any:
        check_bearer(self.spec.token, request.headers.get("authorization"))
        req: ChatRequest = parse(ChatRequest, await read_json(request))
        gen = self._request(req, chat_prompt(req.messages), req.stop_list() + (TURN,))
        rid = new_id("chatcmpl")

        def body(text: str | None, finish: str | None, chunk: bool, use: dict | None = None,
                 first: bool = False) -> dict:
            return chat_body(rid, req.model, self.fingerprint, text, finish, chunk, use, first)
        return await self._respond(req, gen, body)

    # --- plumbing --------------------------------------------------------------------------
    def _request(self, req: "CompletionRequest | ChatRequest", text: str, stop: tuple[str, ...]) -> GenRequest:
        if req.model != self.spec.name:
            raise APIError(400, f"model '{req.model}' is not served here; this server has '{self.spec.name}' "
                                "(see GET /v1/models)", param="model", code="model_not_found")
        ids = prompt_ids(self.tokenizer, text)
        return GenRequest(ids, req.sampling(len(ids), self.context), stop, ignore_eos=req.ignore_eos)

    async def _events(self, gen: GenRequest) -> AsyncIterator[Event]:
        """Engine events for one request; what piles up within stream_interval_ms goes out as one."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Event] = asyncio.Queue()
        if self._pump is None:  # the replica's event loop exists only once requests arrive
            self._pump = EventPump(loop)
        gen.emit = self._pump.emitter(queue.put_nowait)
        try:
            self.engine.submit(gen)
        except QueueFull as exc:
            raise APIError(503, f"server overloaded: {exc}; retry later", "server_error", code="overloaded") from None
        deadline = loop.time() + self.spec.serve.request_timeout_s
        interval = self.spec.serve.stream_interval_ms / 1e3
        done, last_sent = False, 0.0
        try:
            while not done:
                try:
                    ev = await asyncio.wait_for(queue.get(), max(0.0, deadline - loop.time()))
                    wait = last_sent + interval - loop.time()
                    if wait > 0 and ev.finish_reason is None:
                        await asyncio.sleep(wait)
                except asyncio.TimeoutError:
                    raise APIError(408, f"the request ran longer than {self.spec.serve.request_timeout_s:g} s "
                                        "and was cancelled; ask for fewer max_tokens", code="timeout") from None
                while not queue.empty() and ev.finish_reason is None:
                    nxt = queue.get_nowait()
                    ev = Event(ev.text + nxt.text, nxt.finish_reason, nxt.prompt_tokens, nxt.completion_tokens,
                               nxt.error)
                done = ev.finish_reason is not None
                if ev.finish_reason == "error":
                    raise APIError(503, ev.error or "generation failed", "server_error")
                last_sent = loop.time()
                yield ev
        finally:
            if not done:  # the client went away or timed out: free the slot
                self.engine.cancel(gen)

    async def _respond(self, req: "CompletionRequest | ChatRequest", gen: GenRequest, body) -> Any:
        events = self._events(gen)
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

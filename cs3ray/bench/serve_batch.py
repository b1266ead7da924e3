"""The benchmark's peer: Ray Serve's own request-level batching (`@serve.batch`) over our model code.

Serve gathers up to 16 requests (waiting at most 10 ms), and the batch runs on the same engine,
forward pass and sampler as cs3ray's server, but as a closed group: nobody joins until every
member has finished, which is what request-level batching means. Streams leave early, slots
stay idle. Only the scheduling differs from continuous batching.
"""

# No `from __future__ import annotations`: FastAPI must see the real Request class (see app.py).
import asyncio
import dataclasses
import time
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve

from cs3ray.serve.app import load_replica, read_json, sse, start_engine
from cs3ray.serve.pump import EventPump
from cs3ray.serve.schemas import APIError, CompletionRequest, completion_body, new_id, parse, prompt_ids, usage
from cs3ray.serve.sequence import Event, GenRequest
from cs3ray.serve.spec import ServeSpec
from cs3ray.serve.tuning import tune_replica_process

MAX_BATCH_SIZE = 16
BATCH_WAIT_TIMEOUT_S = 0.01
batch_api = FastAPI(docs_url=None, redoc_url=None)


@batch_api.exception_handler(APIError)
async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status)


@serve.deployment
@serve.ingress(batch_api)
class RequestBatchServer:
    """/v1/completions (streaming) with `@serve.batch` deciding who runs together."""

    def __init__(self, spec: ServeSpec) -> None:
        self.spec = spec
        loaded = load_replica(spec, "cpu")
        self.tokenizer, self.context = loaded.tokenizer, loaded.model.args.max_seq_len
        # cs3ray's engine options, but Serve's batch size (the engine never holds more than it hands over).
        options = dataclasses.replace(spec.engine_options(), max_batch=MAX_BATCH_SIZE)
        self.engine = start_engine(loaded.model, loaded.tokenizer.eos_id, options, token_bytes=loaded.tokenizer.token_bytes())
        self.pacer = spec.pacer()
        tune_replica_process()  # as cs3ray's server does

    @batch_api.get("/healthz")
    async def healthz(self) -> dict:
        return {"status": "ok"}

    @batch_api.post("/v1/completions")
    async def completions(self, request: Request) -> Any:
        req = parse(CompletionRequest, await read_json(request))
        if not req.stream:
            raise APIError(400, "this benchmark peer only streams; send stream: true")
        ids = prompt_ids(self.tokenizer, req.text())
        gen = GenRequest(ids, req.sampling(len(ids), self.context), req.stop_list(), ignore_eos=req.ignore_eos)
        rid = new_id("cmpl")

        async def stream() -> AsyncIterator[str]:
            last = Event("")
            async for ev in self._generate(gen):
                last = ev
                if ev.text or ev.finish_reason:
                    yield sse(completion_body(rid, req.model, "batch", ev.text, ev.finish_reason, True))
            yield sse(completion_body(rid, req.model, "batch", None, None, True,
                                      usage(last.prompt_tokens, last.completion_tokens)))
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream")

    @serve.batch(max_batch_size=MAX_BATCH_SIZE, batch_wait_timeout_s=BATCH_WAIT_TIMEOUT_S)
    async def _generate(self, gens: list[GenRequest]) -> AsyncIterator[list]:
        """Run one closed batch; each yield hands every member its newest text (or its end)."""
        loop = asyncio.get_running_loop()
        pump = EventPump(loop)
        queue: asyncio.Queue[tuple[int, Event]] = asyncio.Queue()
        for i, gen in enumerate(gens):
            gen.emit = pump.emitter(lambda ev, i=i: queue.put_nowait((i, ev)))
            gen.arrived = time.perf_counter()
            self.engine.submit(gen)
        # The same transport as cs3ray's server: each member's events since its last chunk go out
        # as one, paced by the same rule (this batch's members count as the replica's streams).
        last_sent, done = 0.0, set()
        while len(done) < len(gens):
            ready = [await queue.get()]
            self.pacer.active = len(gens) - len(done)
            wait = last_sent + self.pacer.interval() - loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            while not queue.empty():
                ready.append(queue.get_nowait())
            out: list[Any] = [StopIteration if i in done else Event("") for i in range(len(gens))]
            for i, ev in ready:
                prev = out[i]
                out[i] = Event(prev.text + ev.text, ev.finish_reason, ev.prompt_tokens, ev.completion_tokens)
            last_sent = loop.time()
            yield out
            done |= {i for i, ev in ready if ev.finish_reason is not None}

"""An open-loop load generator for OpenAI-style streaming completions.

Arrivals are a seeded Poisson process and every request streams its answer, so latency is
seen as a user sees it: TTFT is arrival -> first text, ITL the gap between streamed chunks.
Open loop means a slow server does not slow the arrivals down (a closed loop would hide
queueing): offered concurrency C is turned into a rate by Little's law, C / (unloaded latency).
"""

from __future__ import annotations

import asyncio
import gc
import json
import random
import time
from dataclasses import dataclass, field

import aiohttp

WORDS = ("def class return import self value data model token batch cache server stream for in if else "
         "while with as yield lambda None True False print len range list dict").split()


@dataclass(frozen=True)
class Item:
    """One request of the workload: when it arrives (s after the start), its prompt and length."""

    at: float
    prompt: str
    max_tokens: int
    seed: int


def workload(n: int, rate: float, seed: int, prompt_words: tuple[int, int] = (2, 10),
             output_tokens: tuple[int, int] = (16, 192), context: int = 256) -> list[Item]:
    """n requests with exponential inter-arrival gaps at `rate` per second; all draws seeded.

    Prompt plus output always fits `context` (the prompt's bytes are its tokens, plus one EOS).
    """
    rng = random.Random(seed)
    t, items = 0.0, []
    for i in range(n):
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*prompt_words)))
        out = min(rng.randint(*output_tokens), context - len(prompt.encode()) - 1)
        items.append(Item(t, prompt, out, seed * 100_003 + i))
        t += rng.expovariate(rate)
    return items


@dataclass
class Result:
    ok: bool = False
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    done_at: float = 0.0
    error: str | None = None


async def _one(session: aiohttp.ClientSession, url: str, model: str, item: Item, start: float,
               timeout: float) -> Result:
    await asyncio.sleep(max(0.0, start + item.at - time.perf_counter()))
    sent = time.perf_counter()
    res, last = Result(), None
    body = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens, "temperature": 0.8,
            "seed": item.seed, "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    try:
        async with session.post(f"{url}/v1/completions", json=body,
                                timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                if chunk.get("usage"):
                    res.tokens = chunk["usage"]["completion_tokens"]
                if chunk["choices"] and chunk["choices"][0]["text"]:
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - sent
                    else:
                        res.gaps.append(now - last)
                    last = now
        res.ok = res.error is None and res.tokens == item.max_tokens
        if not res.ok and res.error is None:
            res.error = f"got {res.tokens} of {item.max_tokens} tokens"
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.done_at = time.perf_counter()
    return res


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * len(values) + 0.5) - 1))]


@dataclass
class Replay:
    """One replay of a workload: its requests' results and how long it took."""

    results: list[Result]
    seconds: float


async def _run(url: str, model: str, items: list[Item], timeout: float) -> Replay:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn) as session:
        start = time.perf_counter()
        results = await asyncio.gather(*[_one(session, url, model, it, start, timeout) for it in items])
    end = max((r.done_at for r in results), default=start)
    return Replay(results, max(end - start, 1e-9))


def _gaps_ms(results: list[Result]) -> list[float]:
    return [g * 1e3 for r in results if r.ok for g in r.gaps]


def summarize(replays: list[Replay]) -> dict:
    """Throughput and latency percentiles over one or more replays (pooled: tokens over total time,
    percentiles over every request's samples), with each replay's own tokens/s and p99 gap."""
    results = [r for rep in replays for r in rep.results]
    ok = [r for r in results if r.ok]
    ttfts = [r.ttft * 1e3 for r in ok if r.ttft is not None]
    gaps = _gaps_ms(results)
    errors = [r.error for r in results if not r.ok]
    return {"tokens_per_s": sum(r.tokens for r in ok) / sum(rep.seconds for rep in replays),
            "p50_ttft_ms": _pct(ttfts, 50), "p99_ttft_ms": _pct(ttfts, 99), "p99_itl_ms": _pct(gaps, 99),
            "p50_itl_ms": _pct(gaps, 50), "p90_itl_ms": _pct(gaps, 90), "max_itl_ms": max(gaps, default=float("nan")),
            "errors": len(errors), "requests": len(results), "first_error": errors[0] if errors else None,
            "tokens_per_chunk": sum(r.tokens for r in ok) / max(1, sum(len(r.gaps) + 1 for r in ok)),
            "replay_tokens_per_s": [sum(r.tokens for r in rep.results if r.ok) / rep.seconds for rep in replays],
            "replay_p99_itl_ms": [_pct(_gaps_ms(rep.results), 99) for rep in replays]}


def replay(url: str, model: str, items: list[Item], timeout: float = 300.0) -> Replay:
    """Replay `items` against url's /v1/completions.

    The heap loaded so far is frozen out of the garbage collector first: in a driver that has
    imported torch, Ray and Serve, a full collection stalls the load generator mid-run, which the
    percentiles would charge to the server (figures: docs/benchmarks.md). No gc.collect() before
    it: that would walk the same heap at every call.
    """
    gc.freeze()
    try:
        return asyncio.run(_run(url, model, items, timeout))
    finally:
        gc.unfreeze()


def run_load(url: str, model: str, items: list[Item], timeout: float = 300.0) -> dict:
    """One replay of `items`, summarized: throughput and latency percentiles."""
    return summarize([replay(url, model, items, timeout)])

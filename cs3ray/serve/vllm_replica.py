"""A serve.engine=vllm replica's setup: the checkpoint's export, the run's tokenizer and context, vLLM
started with the serve section's values, and --follow rolling the engine over to newer checkpoints."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import yaml

from cs3ray.ckpt import resolve_checkpoint
from cs3ray.config import stored_config
from cs3ray.errors import UserError
from cs3ray.models import Tokenizer, check_same, tokenizer_from_json
from cs3ray.models.generate import SamplingParams

from .engine import Metrics
from .follow import Follower
from .sequence import Event, GenRequest
from .spec import ServeSpec
from .vllm_engine import VLLMEngine, VLLMOptions
from .vllm_export import CS3_CONFIG, CS3_TOKENIZER, Export, cached_export

log = logging.getLogger(__name__)


@dataclass
class VLLMReplica:
    """What the routes need from a vLLM replica: its engine, the run's tokenizer and context."""

    engine: VLLMEngine
    tokenizer: Tokenizer
    context: int
    export: Export


def vllm_device(spec: ServeSpec) -> str:
    """Where vLLM runs: GPUs when the serve section gives the replica (or its workers) GPUs, else the CPU."""
    return "cuda" if spec.serve.num_gpus > 0 else "cpu"


def export_for(spec: ServeSpec, device: str) -> Export:
    """The run's newest good checkpoint as an HF directory in serve.dtype for `device` (cached per step)."""
    return cached_export(spec.run, spec.storage_options, spec.dtype(device), spec.serve.export_dir,
                         replicas=spec.ckpt_replicas, stored_replicas=spec.stored_replicas)


def read_export(export: Export) -> tuple[Tokenizer, int]:
    """The run's tokenizer and context length, from the cs3ray files the export carries."""
    where = Path(export.path)
    tok = tokenizer_from_json((where / CS3_TOKENIZER).read_text(), f"'{where / CS3_TOKENIZER}'")
    cfg = stored_config(yaml.safe_load((where / CS3_CONFIG).read_text()), source=str(where / CS3_CONFIG))
    return tok, cfg.model.args().max_seq_len


def start_vllm(spec: ServeSpec, metrics: Metrics | None = None) -> VLLMReplica:
    """Export (or find) the checkpoint and start vLLM on it with serve.tp x serve.pp devices."""
    device = vllm_device(spec)
    export = export_for(spec, device)
    tokenizer, context = read_export(export)
    s = spec.serve
    options = VLLMOptions(dtype=spec.dtype(device), max_model_len=context, max_batch=s.max_batch,
                          tp=s.tp, pp=s.pp, device=device, kv_cache_mb=s.kv_cache_mb, eager=s.eager)
    engine = VLLMEngine(export.path, options, metrics, step=export.step)
    return VLLMReplica(engine, tokenizer, context, export)


class VLLMFollower(Follower):
    """--follow for vLLM: a newer checkpoint is exported, a new engine starts on it and takes new requests,
    and the old one stops once the requests it runs have finished (engine.swap_checkpoint)."""

    def __init__(self, spec: ServeSpec, replica: VLLMReplica, on_switch: Callable[[int], None]) -> None:
        self.replica, self.on_switch = replica, on_switch
        self.step = replica.export.step
        super().__init__(spec, resolve_checkpoint(spec.run, spec.storage_options).url, lambda *_: None,
                         vllm_device(spec), spec.dtype(vllm_device(spec)), replica.tokenizer)

    def poll(self) -> bool:
        newest = resolve_checkpoint(self.spec.run, self.spec.storage_options).url
        if newest == self.seen:
            return False
        self.seen = newest  # a damaged one is refused once (with its warning), not on every poll
        export = export_for(self.spec, self.device)
        if export.step <= self.step:
            return False
        tokenizer, _ = read_export(export)
        check_same(tokenizer, self.replica.tokenizer, f"checkpoint of step {export.step}", "the served model",
                   "restart the deployment to serve it")
        try:
            self.replica.engine.swap_checkpoint(export.path, export.step, drain_s=self.spec.serve.request_timeout_s,
                                                on_switch=self.on_switch)
        except Exception as exc:  # vLLM could not start on it (memory, a bad export): keep serving the old one
            log.warning("not serving step %d: vLLM failed to start on it: %s", export.step, exc)
            return False
        self.step = export.step
        log.info("serving step %d of %s through vLLM", export.step, self.spec.run)
        return True


def generate_once(spec: ServeSpec, prompt: str, params: SamplingParams) -> str:
    """`cs3 generate` with serve.engine=vllm: one continuation of `prompt` by a vLLM engine started for it."""
    replica = start_vllm(spec)
    try:
        ids = replica.tokenizer.encode(prompt)
        budget = replica.context - len(ids) - 1
        if budget <= 0:
            raise UserError(f"the prompt is longer than the model's context ({replica.context} tokens).")

        async def run() -> str:
            events: asyncio.Queue[Event] = asyncio.Queue()
            replica.engine.submit(GenRequest(ids, replace(params, max_tokens=min(params.max_tokens, budget)),
                                             emit=events.put_nowait))
            parts: list[str] = []
            while True:
                ev = await events.get()
                if ev.finish_reason == "error":
                    raise UserError(ev.error or "vLLM failed to generate")
                parts.append(ev.text)
                if ev.finish_reason is not None:
                    return "".join(parts)
        return asyncio.run(run())
    finally:
        replica.engine.stop()

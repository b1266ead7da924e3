"""What a server is asked to serve: one picklable object handed to every replica."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cs3ray.config.schema import ServeConfig
from cs3ray.core.precision import inference_dtype

from .engine import EngineOptions
from .pump import Pacer


@dataclass
class ServeSpec:
    """A checkpoint (or run) to serve and how; built by `cs3 serve` / jobs/serve.py."""

    run: str  # absolute path or URL of a run directory or one checkpoint folder
    name: str  # application name, also the model id clients send
    serve: ServeConfig = field(default_factory=ServeConfig)
    token: str | None = field(default=None, repr=False)  # bearer token; None leaves the API open
    insecure: bool = False  # the user allows an open API on an interface other machines reach
    trust_code: bool = False  # the user allows importing a model.target named by the checkpoint's config
    follow: bool = False  # poll `run` for newer checkpoints and hot-swap them in
    # Checkpoint replicas to fall back to: the user's URLs, and the run's stored ones only when confirmed.
    ckpt_replicas: list[str] = field(default_factory=list)
    stored_replicas: bool = False
    storage_options: dict | None = field(default=None, repr=False)  # credentials: kept out of logs
    route_prefix: str = "/"
    # Extra keys of Serve's autoscaling_config (upscale_delay_s, downscale_delay_s, look_back_period_s...)
    # on top of min/max/target from the serve section; used only when autoscaling is on.
    autoscaling_options: dict = field(default_factory=dict)
    # Streamed chunks per second a replica sends in all (see pump.Pacer): under load each
    # stream's chunks come further apart than serve.stream_interval_ms and carry more tokens.
    stream_events_per_s: float = 1000.0
    log_format: str = "text"  # run.log_format of the checkpoint's config, or the command's: 'json' for JSON replica logs
    run_name: str | None = None  # run.name of the checkpoint's config: the `run` field of JSON logs

    def engine_options(self) -> EngineOptions:
        s = self.serve
        return EngineOptions(max_batch=s.builtin_batch(), kv_cache_mb=s.kv_cache_mb,
                             max_prefill_tokens=s.max_prefill_tokens, threads=s.torch_threads())

    def pacer(self) -> Pacer:
        """A replica's stream pacing: serve.stream_interval_ms, stretched past stream_events_per_s."""
        return Pacer(self.serve.stream_interval_ms / 1e3, self.stream_events_per_s)

    def dtype(self, device: str) -> torch.dtype:
        """The inference dtype serve.dtype asks for on `device` (a named precision as asked)."""
        return inference_dtype(self.serve.dtype, device)

"""Serve application builder for Serve config files: `import_path: jobs.serve_app:app`, with `args`
as jobs/serve.py's options (KubeRay's RayService `serveConfigV2`, `serve deploy`, `serve run`).

The repository root must be on the nodes' PYTHONPATH (deploy/Dockerfile sets it). Serve logs the
args, so the API token comes from CS3_SERVE_TOKEN in the nodes' environment, never from args. The
proxy's host, port and TLS come from the config's `http_options` (`ssl_certfile`, `ssl_keyfile`),
which a builder cannot change.
"""

# No `from __future__ import annotations`: Serve converts args to the model only when the
# builder's annotation is the class itself, not a string.
import os
import sys
from typing import Literal

from pydantic import BaseModel, ConfigDict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cs3ray.serve.deploy import build_app, make_spec  # noqa: E402


class ServeAppArgs(BaseModel):
    """The `args` of the application in a Serve config: jobs/serve.py's options, token excepted."""

    model_config = ConfigDict(extra="forbid")

    run: str  # run directory, run name or checkpoint folder/URL
    name: str | None = None  # model id clients send (default: the run's name); the app's own name is the config's
    replicas: int | None = None
    # Serve's autoscaling (both bounds, or neither: then `replicas`): replicas follow requests in flight.
    min_replicas: int | None = None
    max_replicas: int | None = None
    target_ongoing_requests: float | None = None
    dtype: str | None = None
    follow: bool = False
    max_batch: int | None = None
    storage_options: dict | None = None  # non-secret fsspec options; credentials from the nodes' environment
    # The run's serve section, as `cs3 serve RUN serve.KEY=VALUE` sets it: e.g. {engine: vllm, tp: 2, num_gpus: 1}.
    serve: dict | None = None
    insecure: bool = False
    trust_code: bool = False
    log_format: Literal["text", "json"] | None = None  # replica logs (default: the run's run.log_format)


def app(args: ServeAppArgs):
    """The cs3ray Serve application for `args`; refuses an open API unless args.insecure."""
    # A Serve config's proxy listens on every interface of the node (KubeRay: of the pod), so
    # the API needs a token as jobs/serve.py's default host does.
    spec = make_spec(args.run, name=args.name, token=os.environ.get("CS3_SERVE_TOKEN"), follow=args.follow,
                     host="0.0.0.0", insecure=args.insecure, trust_code=args.trust_code,
                     overrides=(args.serve or {}) | {k: v for k, v in {
                         "replicas": args.replicas, "dtype": args.dtype, "max_batch": args.max_batch,
                         "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                         "target_ongoing_requests": args.target_ongoing_requests}.items() if v is not None},
                     storage_options=args.storage_options, log_format=args.log_format)
    return build_app(spec)

"""Entry point for `ray job submit --working-dir . -- python jobs/serve.py RUN [serve.K=V...] [storage.options.K=V...] [--follow]`.

Inside a Ray job, RAY_ADDRESS points at the cluster, so the app is deployed there, beside any
training job. The job stays up until `ray job stop`, which sends SIGTERM: the app is deleted.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cs3ray.config import runtime_serve_options  # noqa: E402
from cs3ray.errors import UserError  # noqa: E402
from cs3ray.serve.deploy import make_spec, pick_token  # noqa: E402
from cs3ray.serve.launch import run_app  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a cs3ray run on the current Ray cluster.")
    parser.add_argument("run", help="run directory, run name or checkpoint folder/URL")
    parser.add_argument("storage", nargs="*", metavar="serve.KEY=VALUE | storage.options.KEY=VALUE",
                        help="overrides of the run's serve section (e.g. serve.engine=vllm serve.tp=2), and storage "
                             "options for reading the run (credentials may come from the nodes' environment)")
    parser.add_argument("--storage-options", default=None, help="fsspec storage options as JSON")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--name", default=None, help="application name and model id")
    parser.add_argument("--replicas", type=int, default=None, help="replicas (default: from the config)")
    parser.add_argument("--min-replicas", type=int, default=None, help="autoscale from this many replicas (with --max-replicas)")
    parser.add_argument("--max-replicas", type=int, default=None, help="autoscale up to this many replicas")
    parser.add_argument("--target-ongoing-requests", type=float, default=None,
                        help="autoscaling target of requests in flight a replica")
    parser.add_argument("--dtype", default=None, help="auto, bf16, fp16 or fp32")
    parser.add_argument("--follow", action="store_true", help="hot-reload newer checkpoints of RUN")
    parser.add_argument("--max-batch", type=int, default=None, help="sequences batched together (1: no batching)")
    parser.add_argument("--log-format", choices=["text", "json"], default=None,
                        help="replica logs: text or json (default: the run's run.log_format)")
    # The environment variable keeps the token out of the job's entrypoint, which Ray shows and logs.
    parser.add_argument("--token", default=os.environ.get("CS3_SERVE_TOKEN"),
                        help="require 'Authorization: Bearer TOKEN' on the API (default: $CS3_SERVE_TOKEN)")
    parser.add_argument("--token-file", default=None, help="read the API token from this file (a mounted secret)")
    parser.add_argument("--tls-cert", default=None, help="serve HTTPS with this PEM certificate (chain)")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")
    parser.add_argument("--insecure", action="store_true",
                        help="serve an open API (no token) on a non-loopback --host: anyone who reaches it can use it")
    parser.add_argument("--trust-code", action="store_true",
                        help="import and run the model.target code the checkpoint's config names")
    parser.add_argument("--ckpt-replica", action="append", default=[], metavar="URL",
                        help="a copy of the run's checkpoints to fall back to (repeat it)")
    parser.add_argument("--use-stored-replicas", action="store_true",
                        help="also fall back to the checkpoint.replicas the run's stored config lists")
    args = parser.parse_intermixed_args(argv)  # storage options may come after other options
    try:
        options, values = runtime_serve_options(args.storage, args.storage_options)
        given = {"replicas": args.replicas, "dtype": args.dtype, "max_batch": args.max_batch,
                 "min_replicas": args.min_replicas, "max_replicas": args.max_replicas,
                 "target_ongoing_requests": args.target_ongoing_requests,
                 "tls_cert": args.tls_cert, "tls_key": args.tls_key}
        spec = make_spec(args.run, name=args.name, token=pick_token(args.token, args.token_file), follow=args.follow,
                         host=args.host, insecure=args.insecure, trust_code=args.trust_code,
                         overrides=values | {k: v for k, v in given.items() if v is not None},  # the options win
                         storage_options=options,
                         ckpt_replicas=args.ckpt_replica, stored_replicas=args.use_stored_replicas,
                         log_format=args.log_format)
        run_app(spec, args.host, args.port, address=os.environ.get("RAY_ADDRESS", "auto"),
                on_ready=lambda url: print(f"serving {spec.name} at {url}/v1", flush=True))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

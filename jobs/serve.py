"""Entry point for `ray job submit --working-dir . -- python jobs/serve.py RUN [--port 8000] [--follow]`.

Inside a Ray job, RAY_ADDRESS points at the cluster, so the app is deployed there, beside any
training job. The job stays up until `ray job stop`, which sends SIGTERM: the app is deleted.
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cs3ray.errors import UserError  # noqa: E402
from cs3ray.ops.cluster import ray_cluster  # noqa: E402
from cs3ray.serve.deploy import make_spec, serve_foreground  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Serve a cs3ray run on the current Ray cluster.")
    parser.add_argument("run", help="run directory, run name or checkpoint folder/URL")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port of Serve's proxy")
    parser.add_argument("--host", default="0.0.0.0", help="interface to listen on")
    parser.add_argument("--name", default=None, help="application name and model id")
    parser.add_argument("--replicas", type=int, default=None, help="replicas (default: from the config)")
    parser.add_argument("--dtype", default=None, help="auto, bf16, fp16 or fp32")
    parser.add_argument("--follow", action="store_true", help="hot-reload newer checkpoints of RUN")
    args = parser.parse_args(argv)
    try:
        spec = make_spec(args.run, name=args.name, token=os.environ.get("CS3_SERVE_TOKEN"), follow=args.follow,
                         overrides={"replicas": args.replicas, "dtype": args.dtype})
        with ray_cluster(os.environ.get("RAY_ADDRESS", "auto"), quiet=True):
            serve_foreground(spec, args.host, args.port, lambda url: print(f"serving {spec.name} at {url}/v1",
                                                                         flush=True))
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Entry point for `ray job submit --working-dir . -- python jobs/train.py CONFIG [overrides] [--resume|--overwrite]`.

Inside a Ray job, RAY_ADDRESS points at the cluster, so training joins it rather than
starting an embedded one.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cs3ray.config import load_config  # noqa: E402
from cs3ray.errors import UserError  # noqa: E402
from cs3ray.ops.job_credentials import check_config_file, check_overrides  # noqa: E402
from cs3ray.train import TrainingError, train  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Train a cs3ray job on the current Ray cluster.")
    parser.add_argument("config", help="YAML job config")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.lr=3e-4")
    parser.add_argument("--resume", action="store_true", help="continue the run from its newest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="start the run over")
    parser.add_argument("--name", default=None, help="run name (overrides run.name)")
    parser.add_argument("--verbose", "-v", action="store_true", help="show Ray's and the workers' logs")
    args = parser.parse_intermixed_args(argv)  # overrides may come after options, as with `cs3 train`
    overrides = args.overrides + ([f"run.name={args.name}"] if args.name else [])

    def log(event: dict) -> None:
        if event["event"] != "prepare":
            print(json.dumps(event), flush=True)

    try:
        # By now the entrypoint and the config file are stored by the cluster; refusing to use a credential
        # found there makes the leak visible at once (and the docs never put one there).
        check_overrides(overrides, where="in the job's entrypoint")
        check_config_file(args.config)
        summary = train(load_config(args.config, overrides), resume=args.resume, overwrite=args.overwrite,
                        address=os.environ.get("RAY_ADDRESS", "auto"), on_event=log, quiet=not args.verbose)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainingError as exc:
        print(f"error: training failed: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"summary": summary}), flush=True)
    return 0


if __name__ == "__main__":
    from cs3ray.ops.process_exit import exit_now

    exit_now(main())  # the job ends once its summary is out, not after the interpreter's teardown

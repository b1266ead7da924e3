"""`ray start` for a node that keeps its loopback address: `python -m cs3ray.ops.loopback_start start ARGS`.

`ray start --node-ip-address=127.0.0.1` swaps a loopback address for the machine's own, so that other
machines could join, and Ray's servers then listen on every interface. `cs3 up` without `--host`
means this machine only, so its nodes keep the address as given, and every Ray server of the node
binds 127.0.0.1 (Ray's single-machine mode would do the same for a head but refuses worker nodes).
The node's children (raylet, workers, job drivers) run in that mode, so that a driver joining at
127.0.0.1 (a job's entrypoint) reaches the GCS there instead of at the machine's address.
"""

from __future__ import annotations

import os
import sys


def main() -> None:
    """Ray's own `ray` command, with the node address taken as given."""
    from ray._private import services
    from ray.scripts.scripts import main as ray_main

    services.resolve_ip_for_localhost = lambda host: host
    # Read by the node's processes when they import ray; this one imported it already (worker nodes allowed).
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    sys.argv = ["ray", *sys.argv[1:]]
    ray_main()


if __name__ == "__main__":
    main()

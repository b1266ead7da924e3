"""The shard cache's counters on Prometheus: one series per node and run, whatever the node's processes.

Ray labels every series a process exports with its `WorkerId` (Ray 2.60 drops that label only from its
own task and actor counts), so a counter each worker incremented would be one series per process, and
a new set after every restart. Each process instead sends what its counters grew by to one small
actor on its node (`cs3-cache-metrics-<node id>`, namespace cs3ray, no CPU), which owns the node's
counters, tagged `node` (host name) and `run`. The actor is detached: it outlives runs, so a node's
series stay one while runs come and go (`ray kill` it to remove it; the next cache starts another).
"""

from __future__ import annotations

import functools
import socket
from typing import Any

NAMESPACE = "cs3ray"
# CacheStats field -> (metric name as declared; Ray appends "_total" to a counter, description).
COUNTERS: dict[str, tuple[str, str]] = {
    "l1_hits": ("cs3_cache_l1_hits", "reads served from the process's memory (L1)"),
    "l1_misses": ("cs3_cache_l1_misses", "reads not in memory (L1)"),
    "l1_bytes": ("cs3_cache_l1_bytes", "bytes served from memory (L1)"),
    "l1_evictions": ("cs3_cache_l1_evictions", "shards evicted from memory (L1)"),
    "l2_hits": ("cs3_cache_l2_hits", "reads served from the node's disk (L2)"),
    "l2_misses": ("cs3_cache_l2_misses", "reads not on the node's disk (L2)"),
    "l2_bytes": ("cs3_cache_l2_bytes", "bytes served from the node's disk (L2)"),
    "l2_evictions": ("cs3_cache_l2_evictions", "shards evicted from the node's disk (L2)"),
    "l2_corrupt": ("cs3_cache_l2_corrupt", "shards on disk (L2) that failed their checksum and were fetched again"),
    "l3_reads": ("cs3_cache_l3_reads", "shards fetched from the shard set's storage (L3)"),
    "l3_bytes": ("cs3_cache_l3_bytes", "bytes fetched from the shard set's storage (L3)"),
    "l3_retries": ("cs3_cache_l3_retries", "retried reads from storage (L3)"),
    "prefetched": ("cs3_cache_prefetched", "shards fetched ahead of their read"),
    "wait_s": ("cs3_cache_wait_seconds", "seconds workers waited for data"),
}


@functools.cache  # one actor class per process: each definition is exported to the cluster again
def _actor_class():
    import ray

    @ray.remote(num_cpus=0, max_restarts=-1)
    class NodeCacheCounters:
        """A node's cache counters; processes of the node add to them."""

        def __init__(self) -> None:
            from ray.util.metrics import Counter

            self.counters = {k: Counter(name, description=f"cs3ray shard cache: {desc}", tag_keys=("node", "run"))
                             for k, (name, desc) in COUNTERS.items()}

        def add(self, node: str, run: str, grown: dict[str, float]) -> None:
            for key, value in grown.items():
                if key in self.counters and value > 0:  # a Ray counter takes positive increments only
                    self.counters[key].inc(float(value), tags={"node": node, "run": run})

    return NodeCacheCounters


class NodePublisher:
    """Sends one process's counter growth to its node's actor (inside Ray only; best effort)."""

    def __init__(self, run: str = "") -> None:
        self.run, self.node = run, socket.gethostname()
        self._actor: Any = None
        self._sent: dict[str, float] = {}

    def _handle(self):
        if self._actor is None:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            node_id = ray.get_runtime_context().get_node_id()
            self._actor = _actor_class().options(
                name=f"cs3-cache-metrics-{node_id}", namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote()
        return self._actor

    def publish(self, data: dict[str, float], wait: bool = False) -> None:
        """Add what each counter grew by since the last call; `wait`: until the actor has it (a process's last)."""
        import ray

        if not ray.is_initialized():  # a plain CLI run: the stats files only
            return
        grown = {k: float(data[k]) - self._sent.get(k, 0.0) for k in COUNTERS if k in data}
        grown = {k: v for k, v in grown.items() if v > 0}
        if not grown:
            return
        ref = self._handle().add.remote(self.node, self.run, grown)
        self._sent.update({k: float(data[k]) for k in grown})
        if wait:
            ray.get(ref, timeout=10)

"""The tiered shard cache: L1 this process's memory -> L2 the node's local disk -> L3 any fsspec URL.

L1 belongs to one process (each worker has its own); L2 is shared by every process on a node.
Modules: `policy` (eviction), `memory` (L1), `disk` (L2, shared by a node's processes),
`remote` (L3 with retries: `cs3ray.storage.retry`), `tiered` (the read-through cache and
prefetch), `stats` (counters and their files), `node_metrics` (the counters on Prometheus, one series per node and run), `locking`, `node` (warm, stats and clear of a
node's L2: what `cs3 cache` calls), and `datasource` (Ray Data reads through the cache; imported on
its own because it needs Ray).
"""

from .errors import CacheError
from .node import clear_node, node_stats, warm_node
from .policy import LRU, NoEvict, make_policy
from .stats import CacheStats, read_all, total
from .tiered import TieredCache, from_config, namespace, node_cache

__all__ = ["CacheError", "CacheStats", "LRU", "NoEvict", "TieredCache", "clear_node", "from_config", "make_policy",
           "namespace", "node_cache", "node_stats", "read_all", "total", "warm_node"]

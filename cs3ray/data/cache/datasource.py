"""A Ray Data datasource whose read tasks fetch shards through the node-local tiered cache.

Each read task runs on some node of the cluster and reads its shard with that node's
process cache (L1) and shared disk directory (L2), so a second pass over the data never
goes back to object storage. Rows are the shards' samples (column 'tokens'), decoded in the read
task into a fixed-shape uint16 tensor column (cs3ray.data.rows), which Ray Data hands to numpy
consumers as one (rows, seq_len+1) array without a copy.
"""

from __future__ import annotations

from ray.data.block import BlockMetadata
from ray.data.datasource import Datasource, ReadTask

from ..rows import rows_table
from ..stream import decode_shard
from .tiered import node_cache


class CachedShardsDatasource(Datasource):
    """One read task per shard, in the order given; every read goes through `node_cache`."""

    def __init__(self, url: str, options: dict, entries: list[dict], cache_cfg: dict) -> None:
        super().__init__()
        self.url, self.options, self.entries, self.cache_cfg = url, options, entries, cache_cfg

    def estimate_inmemory_data_size(self) -> int:
        return sum(e["bytes"] for e in self.entries)

    def get_read_tasks(self, parallelism: int, per_task_row_limit: int | None = None,
                       data_context=None) -> list[ReadTask]:
        url, options, entries, cfg = self.url, self.options, self.entries, self.cache_cfg

        def make(entry: dict) -> ReadTask:
            def read():
                cache = node_cache(url, options, entries, cfg)
                data = cache.get(entry["file"])
                # A read task may be this worker's last for a long while: write its counters now
                # (one small file per shard read), not only every few seconds.
                cache.writer.flush()
                yield rows_table(decode_shard(data))

            meta = BlockMetadata(num_rows=entry["samples"], size_bytes=entry["bytes"],
                                 input_files=(f"{url}/{entry['file']}",), exec_stats=None)
            return ReadTask(read, meta, per_task_row_limit=per_task_row_limit)

        return [make(e) for e in entries]

    @property
    def supports_distributed_reads(self) -> bool:
        return True

    def get_name(self) -> str:
        return "CachedShards"

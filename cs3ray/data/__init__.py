"""Data: corpus -> token shards, and the stream of shards into training workers."""

from .corpus import DataError, open_corpus
from .prepare import prepare_shards_ray
from .shard_source import prepared_shards
from .shards import ShardSpec, ensure_shards, prepare_shards, read_manifest, read_split, shard_tokenizer
from .tokenizer import train_tokenizer

__all__ = ["DataError", "ShardSpec", "ensure_shards", "open_corpus", "prepare_shards", "prepare_shards_ray",
           "prepared_shards", "read_manifest", "read_split", "shard_tokenizer", "train_tokenizer"]

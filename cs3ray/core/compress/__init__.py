"""Gradient compression: codecs, error feedback, a two-phase compressed all-reduce, its DDP hook and FSDP2 comm."""

from .allreduce import CommStats, CompressedAllReduce, ring_bytes
from .codec import BF16Codec, Codec, Int4SparseCodec, Int8Codec, error_bound, make_codec
from .feedback import ErrorFeedback
from .fsdp import CompressedReduceScatter, install_fsdp_compression
from .hierarchical import HierarchicalAllReduce
from .hook import CompressionHook, compress_hook, register_compression
from .shm import ShmAllReduce

__all__ = ["BF16Codec", "Codec", "CommStats", "CompressedAllReduce", "CompressedReduceScatter", "CompressionHook",
           "ErrorFeedback", "HierarchicalAllReduce", "Int4SparseCodec", "Int8Codec", "ShmAllReduce", "compress_hook",
           "error_bound", "install_fsdp_compression", "make_codec", "register_compression", "ring_bytes"]

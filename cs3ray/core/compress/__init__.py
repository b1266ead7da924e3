"""Gradient compression: codecs, error feedback, a two-phase compressed all-reduce, its DDP hook and FSDP2 comm."""

from .allreduce import CommStats, CompressedAllReduce, ring_bytes
from .codec import BF16Codec, Codec, Int4SparseCodec, Int8Codec, error_bound, make_codec
from .dgc import DgcSettings, MomentumCorrection, clip_local, warmup_density
from .feedback import ErrorFeedback
from .fsdp import CompressedReduceScatter, PlainReduceScatter, install_fsdp_compression, install_plain_reduce_scatter
from .hierarchical import HierarchicalAllReduce
from .hook import CompressionHook, compress_hook, register_compression
from .shm import ShmAllReduce

__all__ = ["BF16Codec", "Codec", "CommStats", "CompressedAllReduce", "CompressedReduceScatter", "CompressionHook",
           "DgcSettings", "ErrorFeedback", "MomentumCorrection", "clip_local", "warmup_density", "HierarchicalAllReduce", "Int4SparseCodec", "Int8Codec", "PlainReduceScatter", "ShmAllReduce", "compress_hook",
           "error_bound", "install_fsdp_compression", "install_plain_reduce_scatter", "make_codec", "register_compression", "ring_bytes"]

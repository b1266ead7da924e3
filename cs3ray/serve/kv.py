"""A slot-based KV cache for continuous batching: one fixed slot per running sequence.

`cs3ray.models.KVCache` shares one length across its batch, which suits static batches only.
Here every slot keeps its own length, so sequences join and leave between decode steps, and a
token budget (the memory limit) decides how many can run at once; the rest wait in the queue.
"""

from __future__ import annotations

import heapq

import torch

from cs3ray.models import ModelArgs


def cache_dtype(model_dtype: torch.dtype, device: torch.device | str) -> torch.dtype:
    """Keys/values stay fp32 on CPU: its bf16 attention kernels are much slower than fp32 ones at decode
    shapes (figures: docs/benchmarks.md), and a CPU-sized model's cache is small; accelerators keep the model dtype."""
    return torch.float32 if torch.device(device).type == "cpu" else model_dtype


def bytes_per_token(args: ModelArgs, dtype: torch.dtype) -> int:
    """KV bytes one token of one sequence occupies across all layers (keys + values)."""
    return 2 * args.n_layers * args.kv_heads * args.head_dim * torch.empty((), dtype=dtype).element_size()


class SlotCache:
    """Keys/values of shape (layers, slots, kv_heads, max_len, head_dim); a slot holds one sequence.

    A slot spans the whole context, so a running sequence can never run out of cache half-way;
    the memory budget sets the number of slots, and requests wait while every slot is taken.
    """

    def __init__(self, args: ModelArgs, slots: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> None:
        dtype = cache_dtype(dtype, device)
        shape = (args.n_layers, slots, args.kv_heads, args.max_seq_len, args.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free = list(range(slots))  # a heap: the lowest free slot goes first

    @classmethod
    def for_budget(cls, args: ModelArgs, max_batch: int, budget_bytes: int, dtype: torch.dtype,
                   device: torch.device | str = "cpu") -> "SlotCache":
        """As many slots as `budget_bytes` holds, at most `max_batch`."""
        per_slot = bytes_per_token(args, cache_dtype(dtype, device)) * args.max_seq_len
        if budget_bytes < per_slot:
            raise ValueError(f"a KV budget of {budget_bytes / 2**20:.1f} MiB is less than one full context "
                             f"({per_slot / 2**20:.1f} MiB); raise serve.kv_cache_mb")
        return cls(args, min(max_batch, budget_bytes // per_slot), dtype, device)

    @property
    def slots(self) -> int:
        return self.k.shape[1]

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        """The lowest free slot (callers check free_slots first)."""
        return heapq.heappop(self._free)

    def release(self, slot: int) -> None:
        heapq.heappush(self._free, slot)

    def relocate(self, src: int, dst: int, length: int) -> None:
        """Move a sequence's first `length` positions from slot src to the free slot dst, freeing src.

        Keeping running sequences in the lowest slots lets a decode step read the cache as a
        view instead of gathering it (a gather copies every key each step).
        """
        self._free.remove(dst)
        heapq.heapify(self._free)
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]
        heapq.heappush(self._free, src)

    def index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row numbers, in a layer's (slot, head, position) rows, of tokens at (slots[i], positions[i]):
        (tokens * kv_heads,), in the order of k.reshape(-1, head_dim) for k (tokens, kv_heads, head_dim).

        Computed once per forward, it turns every layer's cache write into one index_copy_.
        """
        _, _, heads, length, _ = self.k.shape
        heads_ = torch.arange(heads, device=slots.device).view(1, heads)
        return ((slots.view(-1, 1) * heads + heads_) * length + positions.view(-1, 1)).reshape(-1)

    def write(self, layer: int, where: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape (tokens, kv_heads, head_dim) at the rows `where` (see index)."""
        d = k.shape[-1]
        self.k[layer].view(-1, d).index_copy_(0, where, k.reshape(-1, d).to(self.k.dtype))
        self.v[layer].view(-1, d).index_copy_(0, where, v.reshape(-1, d).to(self.v.dtype))

    @staticmethod
    def first_of(slots: torch.Tensor) -> int | None:
        """The first slot when `slots` are consecutive (read can then hand out views), else None.
        Checked once per forward rather than per layer."""
        first, b = int(slots[0]), slots.shape[0]
        if int(slots[-1]) - first == b - 1 and bool((slots.diff() == 1).all()):
            return first
        return None

    def read(self, layer: int, slots: torch.Tensor, length: int,
             first: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the given slots up to `length` positions: (batch, kv_heads, length, head_dim).
        `first` is first_of(slots): a caller reading every layer checks the slots once."""
        if first is not None:
            # Consecutive slots (the usual case: the lowest free slot is handed out first) are a view.
            b = slots.shape[0]
            return self.k[layer, first:first + b, :, :length], self.v[layer, first:first + b, :, :length]
        # Otherwise gather; index_select on the slot axis is far faster than mixed advanced indexing.
        return (self.k[layer, :, :, :length].index_select(0, slots),
                self.v[layer, :, :, :length].index_select(0, slots))

    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2

"""Gradient codecs: a 1-D fp32 tensor <-> a uint8 payload whose size depends only on the codec and length.

A fixed size per length lets the transport exchange payloads with equal-split collectives and
count the bytes sent exactly. Payloads are padded to a multiple of 4 bytes so every fp32 / int32
field inside a payload received into a larger buffer stays aligned.
Non-finite inputs (an fp16 overflow) decode to non-finite values, so the loss scaler still sees them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

BLOCK = 256  # values per absmax scale
_BITS = torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8)


def _pad4(n: int) -> int:
    return -n % 4


def _finish(parts: list[torch.Tensor], size: int) -> torch.Tensor:
    """Concatenate payload fields and pad to `size` bytes."""
    out = torch.zeros(size, dtype=torch.uint8)
    torch.cat([p.reshape(-1).view(torch.uint8) for p in parts], out=out[:sum(p.numel() * p.element_size()
                                                                         for p in parts)])
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of BLOCK values, zero-padded (a view when it divides evenly)."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.reshape(-1, BLOCK)
    rows = x.new_zeros(math.ceil(n / BLOCK) * BLOCK)
    rows[:n] = x
    return rows.view(-1, BLOCK)


def _block_scales(rows: torch.Tensor, levels: int) -> torch.Tensor:
    """Per-row absmax / levels."""
    # amin and amax separately: torch's fused aminmax over rows is many times slower on the CPU.
    low, high = rows.amin(dim=1), rows.amax(dim=1)
    return torch.maximum(-low, high) / levels


def _quantize(x: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest integers in [-levels, levels] and their fp32 block scales."""
    rows = _rows(x)
    scales = _block_scales(rows, levels)
    # A multiply by the reciprocal instead of a divide per value; an all-zero block gets 0.
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    q = torch.mul(rows, inv[:, None]).round_().clamp_(-levels, levels)
    return q.reshape(-1)[:x.numel()].to(torch.int8), scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    n = q.numel()
    rows = q.new_zeros(scales.numel() * BLOCK, dtype=torch.float32)
    rows[:n] = q
    # Multiplying by the scale (never skipping zero blocks) turns an inf/nan scale into non-finite output.
    return (rows.view(-1, BLOCK) * scales[:, None]).reshape(-1)[:n]


_SAMPLE = 65536


def _top_k(mag: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted positions of the k largest magnitudes (exact; nan counts as largest, so it is always sent).

    On large inputs a threshold from a fixed sample, set a little below the k-th largest, picks
    candidates and top-k runs on those only, which costs less than top-k over everything and is
    exact whenever at least k candidates pass (otherwise it falls back to the full top-k).
    """
    n = mag.numel()
    if n > 4 * _SAMPLE and not bool(torch.isnan(mag.sum())):
        sample = mag[torch.randint(0, n, (_SAMPLE,), generator=torch.Generator().manual_seed(0))]
        threshold = torch.quantile(sample, max(0.0, 1 - 1.25 * k / n))
        candidates = (mag >= threshold).nonzero().squeeze(1)
        if candidates.numel() >= k:
            return candidates[torch.topk(mag[candidates], k, sorted=False).indices].sort().values
    return torch.topk(mag, k, sorted=False).indices.sort().values


@dataclass(frozen=True)
class Codec:
    """Base: identity fp32 (the `none` codec; used for warm-up and as the reference)."""

    name: str = "none"

    def wire_bytes(self, n: int) -> int:
        """Exact payload bytes for `n` values."""
        return 4 * n

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Payload (uint8, wire_bytes(len(x))) of a 1-D fp32 tensor."""
        return x.detach().float().contiguous().view(torch.uint8).clone()

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        """The fp32 values a payload of `n` values stands for (may share the payload's memory)."""
        return payload[:4 * n].view(torch.float32)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x))."""
        return self.decode(self.encode(x), x.numel())


@dataclass(frozen=True)
class BF16Codec(Codec):
    name: str = "bf16"

    def wire_bytes(self, n: int) -> int:
        return 2 * n + _pad4(2 * n)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return _finish([x.detach().to(torch.bfloat16)], self.wire_bytes(x.numel()))

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        return payload[:2 * n].view(torch.bfloat16).float()


@dataclass(frozen=True)
class Int8Codec(Codec):
    """int8 values with one fp32 absmax/127 scale per BLOCK values: 1 + 4/BLOCK bytes a value."""

    name: str = "int8"

    def wire_bytes(self, n: int) -> int:
        raw = 4 * math.ceil(n / BLOCK) + n
        return raw + _pad4(raw)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        q, scales = _quantize(x.detach().float(), 127)
        return _finish([scales, q], self.wire_bytes(x.numel()))

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        nb = math.ceil(n / BLOCK)
        scales = payload[:4 * nb].view(torch.float32)
        return _dequantize(payload[4 * nb:4 * nb + n].view(torch.int8), scales)


@dataclass(frozen=True)
class Int4SparseCodec(Codec):
    """The k = ceil(density x n) largest magnitudes, 4-bit (absmax/7 per BLOCK kept values).

    Positions go as a bitmask (n/8 bytes) or as int16/int32 indices, whichever is smaller for (n, k),
    so the decoder knows the layout from the length alone. Exact top-k keeps the size fixed.
    """

    name: str = "int4_sparse"
    density: float = 0.1

    def kept(self, n: int) -> int:
        """Values sent out of n."""
        return min(n, max(1, math.ceil(self.density * n))) if n else 0

    def _layout(self, n: int) -> tuple[int, int, int, bool]:
        """(kept k, scale bytes, position bytes, positions as bitmask)."""
        k = self.kept(n)
        index_width = 2 if n <= 2**15 else 4
        mask_bytes = math.ceil(n / 8)
        bitmask = mask_bytes <= index_width * k
        return k, 4 * math.ceil(k / BLOCK), mask_bytes if bitmask else index_width * k, bitmask

    def wire_bytes(self, n: int) -> int:
        k, scale_bytes, pos_bytes, _ = self._layout(n)
        raw = scale_bytes + pos_bytes + math.ceil(k / 2)
        return raw + _pad4(raw)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        x = x.detach().float().reshape(-1)
        n = x.numel()
        k, _, _, bitmask = self._layout(n)
        if k == 0:
            return torch.zeros(0, dtype=torch.uint8)
        idx = _top_k(x.abs(), k)
        q, scales = _quantize(x[idx], 7)
        nibbles = (q + 8).to(torch.uint8)  # 1..15
        if k % 2:
            nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
        packed = nibbles[0::2] | (nibbles[1::2] << 4)
        if bitmask:
            mask = torch.zeros(math.ceil(n / 8) * 8, dtype=torch.uint8)
            mask[idx] = 1
            positions = (mask.view(-1, 8) * _BITS).sum(dim=1, dtype=torch.uint8)
        else:
            positions = idx.to(torch.int16 if n <= 2**15 else torch.int32)
        return _finish([scales, positions, packed], self.wire_bytes(n))

    def decode(self, payload: torch.Tensor, n: int) -> torch.Tensor:
        k, scale_bytes, pos_bytes, bitmask = self._layout(n)
        out = torch.zeros(n, dtype=torch.float32)
        if k == 0:
            return out
        scales = payload[:scale_bytes].view(torch.float32)
        pos = payload[scale_bytes:scale_bytes + pos_bytes]
        if bitmask:
            bits = (pos[:, None] & _BITS).ne(0).reshape(-1)[:n]
            idx = bits.nonzero().squeeze(1)
        else:
            idx = pos.view(torch.int16 if n <= 2**15 else torch.int32).long()
        packed = payload[scale_bytes + pos_bytes:scale_bytes + pos_bytes + math.ceil(k / 2)]
        nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:k]
        out[idx] = _dequantize(nibbles.to(torch.int8) - 8, scales)
        return out


def make_codec(name: str, density: float = 0.1) -> Codec:
    """The codec `compression.codec` names."""
    if name == "none":
        return Codec()
    if name == "bf16":
        return BF16Codec()
    if name == "int8":
        return Int8Codec()
    if name == "int4_sparse":
        return Int4SparseCodec(density=density)
    raise ValueError(f"unknown compression codec {name!r}")


def error_bound(codec: Codec, x: torch.Tensor) -> torch.Tensor:
    """Per-value bound on |roundtrip(x) - x| for finite x (what the tests hold the codecs to)."""
    x = x.detach().float().reshape(-1)
    if codec.name == "none":
        return torch.zeros_like(x)
    if codec.name == "bf16":
        return x.abs() * 2.0**-8
    if codec.name == "int8":
        scales = _block_scales(_rows(x), 127)
        # Half a step of rounding, plus the fp32 rounding of scale and product.
        return (scales.repeat_interleave(BLOCK)[:x.numel()] * 0.5001) + x.abs() * 2.0**-22
    assert isinstance(codec, Int4SparseCodec)
    k = codec.kept(x.numel())
    # A dropped value is no larger than the smallest kept one; a kept one is off by half a step of absmax/7.
    threshold = torch.topk(x.abs(), k).values.min() if k else x.abs().max()
    return torch.full_like(x, float(max(threshold, x.abs().max() / 7 * 0.5001))) + x.abs() * 2.0**-22

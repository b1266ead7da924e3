"""Gradient codecs: a 1-D fp32 tensor <-> a uint8 payload whose size depends only on the codec and length.

A fixed size per length lets the transport exchange payloads with equal-split collectives and
count the bytes sent exactly. Payloads are padded to a multiple of 4 bytes so every fp32 / int32
field inside a payload received into a larger buffer stays aligned.
Non-finite inputs (an fp16 overflow) decode to non-finite values, so the loss scaler still sees them.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import ClassVar

import torch

from ..fake import host_bool, is_fake

BLOCK = 256  # values per absmax scale
_local = threading.local()


def _pad4(n: int) -> int:
    return -n % 4


def _scratch(name: str, numel: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
    """A buffer this thread's later encodes reuse, on `like`'s device: a fresh large tensor is page-faulted
    in on every call, which costs more than the arithmetic done in it. Its contents last until the
    thread's next encode. (A rehearsal's fake tensors get buffers of their own fake mode.)"""
    bufs = _local.__dict__.setdefault("bufs", {})
    buf = bufs.get(name)
    if (buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != like.device
            or getattr(buf, "fake_mode", None) is not getattr(like, "fake_mode", None)):
        buf = bufs[name] = torch.empty(numel, dtype=dtype, device=like.device)
    return buf[:numel]


def _pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """Bytes of 0/1 (a multiple of 8, 8-byte aligned) -> one bit each, byte i's bit j from mask[8 i + j]."""
    # One multiply moves the 8 bytes' low bits of each little-endian int64 into its top byte, in order.
    return (mask.view(torch.int64) * 0x0102040810204080).view(torch.uint8).view(-1, 8)[:, 7].clone()


_SPREAD: dict[torch.device, torch.Tensor] = {}


def _spread(like: torch.Tensor) -> torch.Tensor:
    """The 8 bytes of 0/1 each byte value unpacks to, as one little-endian int64, on `like`'s device."""
    if like.device not in _SPREAD or is_fake(like):
        bits = torch.arange(256, device=like.device)[:, None] >> torch.arange(8, device=like.device) & 1
        spread = bits.to(torch.uint8).view(torch.int64).reshape(-1)
        if is_fake(like):
            return spread
        _SPREAD[like.device] = spread
    return _SPREAD[like.device]


def _unpack_bits(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of `_pack_bits`: 8 bools per byte."""
    return torch.index_select(_spread(packed), 0, packed.int()).view(torch.uint8).view(torch.bool)


def _payload(size: int, out: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The payload buffer: `out` (uint8, exactly `size` bytes) or a fresh one; the caller fills every byte."""
    if out is None:
        return torch.empty(size, dtype=torch.uint8, device=device)
    if out.dtype != torch.uint8 or out.numel() != size or not out.is_contiguous():
        raise ValueError(f"a payload buffer must be {size} contiguous uint8 bytes, got {out.numel()} {out.dtype}")
    return out


def _fill(payload: torch.Tensor, at: int, field: torch.Tensor) -> int:
    """Write `field`'s bytes into payload from byte `at`; returns the end of the field."""
    raw = field.reshape(-1).view(torch.uint8)
    payload[at:at + raw.numel()].copy_(raw)
    return at + raw.numel()


def _emit(values: torch.Tensor, out: torch.Tensor | None, add: bool) -> torch.Tensor:
    """values itself, or written into `out` (added to it with add=True) as fp32."""
    if out is None:
        return values if values.dtype == torch.float32 else values.float()
    if add:  # converted first: an add of mixed dtypes converts through a fresh buffer
        out.add_(values if values.dtype == torch.float32
                 else _scratch("dequantized", values.numel(), torch.float32, values).copy_(values))
    else:
        out.copy_(values)
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows of BLOCK values, zero-padded (a view when it divides evenly)."""
    n = x.numel()
    if n % BLOCK == 0:
        return x.reshape(-1, BLOCK)
    rows = _scratch("rows", math.ceil(n / BLOCK) * BLOCK, x.dtype, x)
    rows[:n] = x
    rows[n:].zero_()
    return rows.view(-1, BLOCK)


def _block_scales(rows: torch.Tensor, levels: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row absmax / levels (into `out` if given)."""
    # amin and amax separately: torch's fused aminmax over rows is many times slower on the CPU.
    low, high = rows.amin(dim=1), rows.amax(dim=1)
    return torch.maximum(low.neg_(), high, out=out).div_(levels)


def _quantize(x: torch.Tensor, levels: int, scales: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric round-to-nearest integers in [-levels, levels], as fp32 rows of BLOCK (padded), and their
    fp32 block scales (written into `scales` if given)."""
    rows = _rows(x)
    scales = _block_scales(rows, levels, scales)
    # A multiply by the reciprocal instead of a divide per value; an all-zero block gets 0. With a normal
    # scale |x| x its reciprocal stays within levels x (1 + 2^-22), which rounds to at most levels: no clamp.
    inv = torch.where(scales > 0, 1 / scales, torch.zeros_like(scales))
    q = torch.mul(rows, inv[:, None], out=_scratch("q", rows.numel(), torch.float32, rows).view_as(rows))
    tiny = scales < torch.finfo(torch.float32).tiny  # subnormal: an imprecise or infinite reciprocal
    if host_bool(tiny.any(), fake=False):
        q[tiny] = (rows[tiny] / scales[tiny, None]).nan_to_num_(0.0).clamp_(-levels, levels)
    return q.round_(), scales


def _dequantize(q: torch.Tensor, scales: torch.Tensor, out: torch.Tensor | None = None,
                add: bool = False) -> torch.Tensor:
    """q (1-D, any dtype holding integers) x its block's scale, in fp32; into `out` (added with add=True).

    Multiplying by the scale (never skipping zero blocks) turns an inf/nan scale into non-finite output.
    """
    n = q.numel()
    if out is None:
        out, add = torch.empty(n, dtype=torch.float32, device=q.device), False
    full = n - n % BLOCK
    parts = [(q[:full].view(-1, BLOCK), out[:full].view(-1, BLOCK), scales[:full // BLOCK, None])] if full else []
    if full < n:  # the last, partial block
        parts.append((q[full:], out[full:n], scales[full // BLOCK]))
    for src, dst, s in parts:
        # Converted in place first: an op on mixed dtypes converts through a fresh buffer, many times slower.
        if add:
            dst.add_(_scratch("dequantized", src.numel(), torch.float32, src).view_as(src).copy_(src).mul_(s))
        else:
            dst.copy_(src).mul_(s)
    return out


_SAMPLE = 65536


def _top_k(mag: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Sorted positions of the k largest magnitudes (exact; nan counts as largest, so it is always sent),
    and, when it comes for free, a bool mask of them padded with False to a multiple of 8 (else None).

    On large inputs a threshold from a fixed sample, set a little below the k-th largest, picks
    candidates in position order and only the few surplus smallest of them are dropped, which costs
    less than top-k over everything; it is exact whenever at least k candidates pass (otherwise it
    falls back to the full top-k).
    """
    n = mag.numel()
    # Fake tensors (a rehearsal) take the full top-k: the candidates' count is known only with values.
    if n > 4 * _SAMPLE and not is_fake(mag) and not bool(torch.isnan(mag.sum())):
        # index_select: on the CPU it gathers faster than indexing with a tensor.
        draw = torch.randint(0, n, (_SAMPLE,), generator=torch.Generator(mag.device).manual_seed(0), device=mag.device)
        sample = torch.index_select(mag, 0, draw)
        # Aim 2% and four standard errors of the sampled fraction above k, so a shortfall is rare.
        frac = k / n
        above = min(1.0, frac * 1.02 + 4 * math.sqrt(frac * (1 - frac) / _SAMPLE) + 1 / _SAMPLE)
        threshold = torch.kthvalue(sample, max(1, round(_SAMPLE * (1 - above)))).values
        mask = _scratch("mask", math.ceil(n / 8) * 8, torch.bool, mag)
        mask[n:] = False
        candidates = torch.ge(mag, threshold, out=mask[:n]).nonzero().squeeze(1)
        surplus = candidates.numel() - k
        if surplus >= 0:
            keep = torch.ones(candidates.numel(), dtype=torch.bool, device=candidates.device)
            dropped = torch.topk(torch.index_select(mag, 0, candidates), surplus, largest=False, sorted=False).indices
            keep[dropped] = False
            mask[candidates[dropped]] = False
            return candidates.masked_select(keep), mask
    return torch.topk(mag, k, sorted=False).indices.sort().values, None


@dataclass(frozen=True)
class Codec:
    """Base: identity fp32 (the `none` codec; used for warm-up and as the reference)."""

    name: str = "none"
    # Pieces of a multiple of 4 x BLOCK values encode on their own to the same values, in payloads whose
    # sizes add up to the whole's, so a transport may encode and send a chunk piece by piece.
    separable: ClassVar[bool] = False

    def wire_bytes(self, n: int) -> int:
        """Exact payload bytes for `n` values."""
        return 4 * n

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Payload (uint8, wire_bytes(len(x))) of a 1-D fp32 tensor; written into `out` if given."""
        x = x.detach().reshape(-1)
        payload = _payload(self.wire_bytes(x.numel()), out, x.device)
        payload.view(torch.float32).copy_(x)
        return payload

    def encode_sent(self, x: torch.Tensor, out: torch.Tensor | None = None,
                    sent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, decode(payload) bit for bit): what error feedback keeps back and what the owner of a
        chunk uses, written into `sent` if given, else into a buffer this thread's next encode reuses;
        a codec may compute it from what its encoder already holds."""
        payload = self.encode(x, out)
        n = x.numel()
        return payload, self.decode(payload, n, out=sent if sent is not None else _scratch("sent", n, torch.float32, x))

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor | None = None,
               add: bool = False) -> torch.Tensor:
        """The fp32 values a payload of `n` values stands for, written into `out` (added to it with add=True)
        if given; without `out` the result may share the payload's memory."""
        return _emit(payload[:4 * n].view(torch.float32), out, add)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """decode(encode(x))."""
        return self.decode(self.encode(x), x.numel())


@dataclass(frozen=True)
class BF16Codec(Codec):
    name: str = "bf16"
    separable: ClassVar[bool] = True

    def wire_bytes(self, n: int) -> int:
        return 2 * n + _pad4(2 * n)

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        x = x.detach().reshape(-1)
        payload = _payload(self.wire_bytes(x.numel()), out, x.device)
        payload[:2 * x.numel()].view(torch.bfloat16).copy_(x)
        payload[2 * x.numel():].zero_()
        return payload

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor | None = None,
               add: bool = False) -> torch.Tensor:
        return _emit(payload[:2 * n].view(torch.bfloat16), out, add)


@dataclass(frozen=True)
class Int8Codec(Codec):
    """int8 values with one fp32 absmax/127 scale per BLOCK values: 1 + 4/BLOCK bytes a value."""

    name: str = "int8"
    separable: ClassVar[bool] = True

    def wire_bytes(self, n: int) -> int:
        raw = 4 * math.ceil(n / BLOCK) + n
        return raw + _pad4(raw)

    def _encode(self, x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(payload, the quantized integers as fp32 rows): scales and values written straight into the payload."""
        x = x.detach().reshape(-1).float()
        n, nb = x.numel(), math.ceil(x.numel() / BLOCK)
        payload = _payload(self.wire_bytes(n), out, x.device)
        q, _ = _quantize(x, 127, payload[:4 * nb].view(torch.float32))
        payload[4 * nb:4 * nb + n].view(torch.int8).copy_(q.view(-1)[:n])
        payload[4 * nb + n:].zero_()
        return payload, q

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._encode(x, out)[0]

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor | None = None,
               add: bool = False) -> torch.Tensor:
        nb = math.ceil(n / BLOCK)
        return _dequantize(payload[4 * nb:4 * nb + n].view(torch.int8), payload[:4 * nb].view(torch.float32), out, add)


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

    def _encode(self, x: torch.Tensor, out: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(payload, sorted positions kept, their 4-bit values + 8 as uint8)."""
        x = x.detach().float().reshape(-1)
        n = x.numel()
        k, scale_bytes, pos_bytes, bitmask = self._layout(n)
        payload = _payload(self.wire_bytes(n), out, x.device)
        if k == 0:
            return payload, torch.zeros(0, dtype=torch.int64, device=x.device), torch.zeros(0, dtype=torch.uint8, device=x.device)
        idx, mask = _top_k(torch.abs(x, out=_scratch("abs", n, torch.float32, x)), k)
        q, _ = _quantize(torch.index_select(x, 0, idx), 7, payload[:scale_bytes].view(torch.float32))
        nibbles = torch.zeros(k + k % 2, dtype=torch.uint8, device=x.device)
        nibbles[:k] = q.view(-1)[:k] + 8  # 1..15; an odd count's last high nibble stays 0
        if bitmask:
            if mask is None:
                mask = _scratch("mask", math.ceil(n / 8) * 8, torch.bool, x).zero_()
                mask[idx] = True
            at = scale_bytes + pos_bytes
            payload[scale_bytes:at] = _pack_bits(mask.view(torch.uint8))
        else:
            at = _fill(payload, scale_bytes, idx.to(torch.int16 if n <= 2**15 else torch.int32))
        torch.bitwise_or(nibbles[0::2], nibbles[1::2] << 4, out=payload[at:at + (k + 1) // 2])
        payload[at + (k + 1) // 2:].zero_()
        return payload, idx, nibbles[:k]

    def encode(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self._encode(x, out)[0]

    def encode_sent(self, x: torch.Tensor, out: torch.Tensor | None = None,
                    sent: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        payload, idx, nibbles = self._encode(x, out)
        # The kept values as decode computes them, placed without unpacking the positions again.
        sent = (sent if sent is not None else _scratch("sent", x.numel(), torch.float32, x)).zero_()
        if idx.numel():
            scales = payload[:self._layout(x.numel())[1]].view(torch.float32)
            sent.scatter_(0, idx, _dequantize(nibbles.to(torch.int8) - 8, scales))
        return payload, sent

    def decode(self, payload: torch.Tensor, n: int, out: torch.Tensor | None = None,
               add: bool = False) -> torch.Tensor:
        k, scale_bytes, pos_bytes, bitmask = self._layout(n)
        if out is None:
            out, add = torch.zeros(n, dtype=torch.float32, device=payload.device), True
        elif not add:
            out.zero_()
        if k == 0:
            return out
        scales = payload[:scale_bytes].view(torch.float32)
        pos = payload[scale_bytes:scale_bytes + pos_bytes]
        if bitmask:
            # Exactly k positions are set: a static size also runs on fake tensors (a rehearsal).
            idx = torch.nonzero_static(_unpack_bits(pos)[:n], size=k).squeeze(1)
        else:
            idx = pos.view(torch.int16 if n <= 2**15 else torch.int32).long()
        packed = payload[scale_bytes + pos_bytes:scale_bytes + pos_bytes + math.ceil(k / 2)]
        nibbles = torch.stack([packed & 15, packed >> 4], dim=1).reshape(-1)[:k]
        # Positions are distinct, so adding at them is one add per kept value.
        out.index_add_(0, idx, _dequantize(nibbles.to(torch.int8) - 8, scales))
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

"""A two-phase compressed all-reduce whose traffic per rank does not grow with the number of ranks.

Phase 1: each rank splits its tensor into one chunk per rank, encodes the chunks of the other
ranks and exchanges them all-to-all (ZeRO++ qgZ's choice: a reduce-scatter would have to reduce
in the wire's dtype); each rank sums the chunk it owns in fp32, its own part exact and the
others decoded. Phase 2: the owner re-encodes the reduced chunk and an all-gather gives every
rank every reduced chunk, decoded from the same bytes on every rank (the owner too), so
replicas stay bit-identical. Each rank sends 2 (n-1) encoded chunks: 2 (n-1)/n x the encoded
tensor, like a ring all-reduce of it. Both phases carry error feedback: the sender's residual
per chunk it sends and the owner's for its reduced chunk (1-bit Adam's worker and server
compensation), one gradient's worth in all. Both exchanges are point-to-point (`exchange`),
every receive posted before any send. Quantization overlaps the wire: a peer's chunk is sent
piece by piece as it is encoded (codecs whose pieces encode separately), and each piece
received is decoded and added as soon as it arrives.
"""

from __future__ import annotations

import math
from collections.abc import Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ..fake import is_fake
from .codec import BLOCK, Codec
from .dgc import MomentumCorrection
from .feedback import ErrorFeedback


def exchange(send: list[torch.Tensor], recv: list[torch.Tensor], group: Any = None, tag: int = 0) -> None:
    """Send send[r] to group rank r and receive recv[r] from it, with every peer at once (own slot copied).

    Every receive is posted before any send, so both directions of a link carry data together:
    gloo's all_to_all and a send posted before its peer's receive move one direction at a time
    (see docs/benchmarks.md, `bench comm`). Traffic is what all_to_all / all_gather send.
    """
    me = dist.get_rank(group)
    recvs = post_receives(recv, group, tag)
    sends = [post_send(send[r], r, group, tag) for r in recvs]
    if recv[me].data_ptr() != send[me].data_ptr():  # a caller that reads its own slot in place skips the copy
        recv[me].copy_(send[me])
    for req in [*recvs.values(), *sends]:
        req.wait()


def post_receives(recv: list[torch.Tensor], group: Any = None, tag: int = 0) -> dict[int, Any]:
    """Post the receive of recv[r] from every other group rank r; {r: its request}. Post them before any
    send of the same exchange (see `exchange`)."""
    me = dist.get_rank(group)
    return {r: dist.irecv(buf, src=_global(group, r), group=group, tag=tag) for r, buf in enumerate(recv) if r != me}


def post_send(payload: torch.Tensor, rank: int, group: Any = None, tag: int = 0) -> Any:
    """Start sending `payload` to group rank `rank`; the request to wait on before reusing the buffer."""
    return dist.isend(payload, dst=_global(group, rank), group=group, tag=tag)


def _global(group: Any, rank: int) -> int:
    return dist.get_global_rank(group, rank) if group is not None else rank


# Values per separately encoded piece of a chunk (codecs that allow it): a multiple of 4 x BLOCK, large
# enough that the calls cost little next to the arithmetic.
PIECE = 4096 * BLOCK


def ring_bytes(numel: int, world: int) -> float:
    """Bytes one rank sends in an fp32 ring all-reduce of `numel` values: the wire_ratio baseline."""
    return 2 * (world - 1) / world * 4 * numel


@dataclass
class CommStats:
    """Bytes this rank sent, and what an fp32 ring all-reduce of the same tensors would have sent."""

    bytes_sent: int = 0
    fp32_ring_bytes: float = 0.0

    def add(self, sent: int, fp32_ring: float) -> None:
        """Count one collective: bytes sent, and what the fp32 ring collective would have sent."""
        self.bytes_sent += sent
        self.fp32_ring_bytes += fp32_ring

    @property
    def wire_ratio(self) -> float | None:
        """bytes sent / fp32 ring bytes (None before any traffic)."""
        return self.bytes_sent / self.fp32_ring_bytes if self.fp32_ring_bytes else None


class CompressedAllReduce:
    """Mean of a flat fp32 tensor over a process group, compressed by `codec`, with error feedback."""

    def __init__(self, codec: Codec, group: Any = None, error_feedback: bool = True) -> None:
        self.codec, self.group = codec, group
        self.feedback = ErrorFeedback(error_feedback)
        self.momentum: MomentumCorrection | None = None  # DGC: velocities masked where this rank's values were sent
        self.stats = CommStats()
        self._thread: ThreadPoolExecutor | None = None
        # Run `start` on the caller's thread: a rehearsal's fake tensors and observers are per thread.
        self.inline = False
        self._work: dict[str, torch.Tensor] = {}  # scratch buffers, reused by every call

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A scratch tensor reused across calls (one call runs at a time per reducer): a fresh buffer larger
        than glibc's mmap threshold is page-faulted in on every call, which costs more than the copy itself."""
        numel = math.prod(shape)
        buf = self._work.get(name)
        if buf is None or buf.numel() < numel or buf.dtype != dtype or buf.device != device:
            buf = self._work[name] = torch.empty(numel, dtype=dtype, device=device)
        return buf[:numel].view(shape)

    def _reduce_own_chunk(self, key: Hashable, flat: torch.Tensor, average: bool) -> tuple[torch.Tensor, int]:
        """Phase 1: encode one chunk per rank, exchange all-to-all, sum the chunks this rank owns in fp32.

        Returns this rank's reduced chunk and the payload bytes of one chunk.
        """
        world = dist.get_world_size(self.group)
        n = flat.numel()
        c = math.ceil(n / world)
        if n == c * world and flat.dtype == torch.float32:
            chunks = flat.reshape(world, c)
        else:
            chunks = self._buffer("padded", (c * world,), torch.float32, flat.device)
            chunks[:n] = flat.reshape(-1)
            chunks[n:].zero_()
            chunks = chunks.view(world, c)
        size = self.codec.wire_bytes(c)
        me = dist.get_rank(self.group)
        parts = list(self._buffer("recv", (world, size), torch.uint8, flat.device))
        total = self._buffer("total", (c,), torch.float32, flat.device)
        if self.codec.name == "none":  # the exact codec's payload is the chunk itself: no copy
            send = chunks.view(torch.uint8)
            parts[me] = send[me]  # this rank's own chunk is read where it is
            exchange(list(send), parts, self.group, tag=1)
            if world == 1:
                total.copy_(self.codec.decode(parts[0], c))
            else:  # in rank order, the first two in one pass
                torch.add(self.codec.decode(parts[0], c), self.codec.decode(parts[1], c), out=total)
            for part in parts[2:]:
                total += self.codec.decode(part, c)
        else:
            # Each piece of a peer's chunk is sent as soon as it is encoded, and this rank's own chunk is
            # encoded while they travel (gloo moves the bytes on its own threads).
            send = self._buffer("send", (world, size), torch.uint8, flat.device)
            pieces = self._pieces(c)
            recvs = self._post_piece_receives(parts, pieces, tag=1)
            sends = []
            for r in [*range(me + 1, world), *range(me)]:
                for i, (vals, span) in enumerate(pieces):
                    _, sent = self.feedback.encode((key, "send", r), self.codec, chunks[r, vals], out=send[r, span],
                                                   offset=vals.start, length=c)
                    if self.momentum is not None:
                        self.momentum.mask(key, r * c + vals.start, sent)
                    sends.append(post_send(send[r, span], r, self.group, tag=1 + 2 * i))
            # This rank's own chunk never leaves it: it enters the sum exact, with nothing to encode and
            # no residual to keep, while the peers' chunks are on the wire.
            total.copy_(chunks[me])
            if self.momentum is not None:
                self.momentum.mask_all(key, me * c, c)
            for r, (vals, span), req in recvs:  # each piece is added as soon as it has arrived
                req.wait()
                self.codec.decode(parts[r][span], vals.stop - vals.start, out=total[vals], add=True)
            for req in sends:
                req.wait()
        if average:
            total /= world
        return total, size

    def all_reduce(self, key: Hashable, flat: torch.Tensor,
                   out: torch.Tensor | None = None) -> tuple[torch.Tensor, int]:
        """The compressed mean of `flat` over the group and the bytes this rank sent, uncounted in `stats`.

        The mean is received or decoded straight into `out` (which may be `flat`) when its layout
        allows; otherwise it may be a view of a scratch buffer that the next call overwrites.
        """
        world = dist.get_world_size(self.group)
        n = flat.numel()
        total, size = self._reduce_own_chunk(key, flat, average=True)
        c = total.numel()
        sent = 2 * (world - 1) * size
        # Phase 1 has finished reading `flat`, so the result may overwrite it.
        direct = out is not None and out.dtype == torch.float32 and out.is_contiguous() and out.numel() == c * world
        # Phase 2: the owner re-encodes its reduced chunk; every rank decodes the same bytes.
        if self.codec.name == "none":  # fp32 chunks are received straight into place
            gathered = (out.view(world, c).view(torch.uint8) if direct and out is not None
                        else self._buffer("gathered", (world, size), torch.uint8, flat.device))
            exchange([total.view(torch.uint8)] * world, list(gathered), self.group, tag=2)
            return gathered.view(torch.float32).reshape(-1)[:n], sent
        gathered = self._buffer("gathered", (world, size), torch.uint8, flat.device)
        me = dist.get_rank(self.group)
        pieces = self._pieces(c)
        recvs = self._post_piece_receives(list(gathered), pieces, tag=2)
        sends = []
        target = out.view(world, c) if direct and out is not None else self._buffer("result", (world, c), torch.float32, flat.device)
        for i, (vals, span) in enumerate(pieces):
            # The owner's copy is what the others decode from these bytes, bit for bit, without a decode.
            self.feedback.encode((key, "owner"), self.codec, total[vals], out=gathered[me, span],
                                 offset=vals.start, length=c, sent=target[me, vals])
            sends += [post_send(gathered[me, span], r, self.group, tag=2 + 2 * i) for r in range(world) if r != me]
        for r, (vals, span), req in recvs:
            req.wait()
            self.codec.decode(gathered[r, span], vals.stop - vals.start, out=target[r, vals])
        for req in sends:
            req.wait()
        return target.reshape(-1)[:n], sent

    def _pieces(self, c: int) -> list[tuple[slice, slice]]:
        """(values, payload bytes) of each separately encoded piece of a c-value chunk: encoding piece i + 1
        overlaps sending piece i. The payload bytes add up to wire_bytes(c) exactly."""
        if not self.codec.separable or c <= PIECE:
            return [(slice(0, c), slice(0, self.codec.wire_bytes(c)))]
        pieces, at = [], 0
        for lo in range(0, c, PIECE):
            size = self.codec.wire_bytes(min(c, lo + PIECE) - lo)
            pieces.append((slice(lo, min(c, lo + PIECE)), slice(at, at + size)))
            at += size
        return pieces

    def _post_piece_receives(self, bufs: list[torch.Tensor], pieces: list[tuple[slice, slice]],
                             tag: int) -> list[tuple[int, tuple[slice, slice], Any]]:
        """Post the receive of every piece from every peer, piece i under tag + 2 i (the two phases' tags
        stay apart); [(peer, piece, request)] piece by piece, the order to wait on them in."""
        posted = [post_receives([b[span] for b in bufs], self.group, tag + 2 * i) for i, (_, span) in enumerate(pieces)]
        return [(r, piece, req) for piece, reqs in zip(pieces, posted, strict=True) for r, req in reqs.items()]

    def __call__(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """The compressed mean of `flat` (its residuals kept under `key`), blocking; written into `out` if given."""
        result, sent = self.all_reduce(key, flat, out)
        self.stats.add(sent, ring_bytes(flat.numel(), dist.get_world_size(self.group)))
        if out is None:
            return result.clone()
        if is_fake(result) or result.data_ptr() != out.data_ptr():  # (a rehearsal's tensors have no address)
            out.copy_(result.view_as(out))
        return out

    def reduce_scatter(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor, average: bool = True) -> None:
        """Compressed reduce-scatter: `out` gets this rank's 1/n of the sum (mean) of `flat` over ranks.

        `flat` holds the ranks' chunks one after another (FSDP2 pads it to n equal chunks).
        The baseline of its wire_ratio is an fp32 ring reduce-scatter, half an all-reduce.
        """
        world = dist.get_world_size(self.group)
        total, size = self._reduce_own_chunk(key, flat, average)
        self.stats.add((world - 1) * size, ring_bytes(flat.numel(), world) / 2)
        out.copy_(total[:out.numel()].view_as(out))

    def start(self, key: Hashable, flat: torch.Tensor, out: torch.Tensor | None = None) -> torch.futures.Future:
        """Run the all-reduce on this reducer's communication thread; the future's value is the mean.

        One thread runs every call in the order they were started, so every rank issues its
        collectives in the same order (a collective issued from a completion callback would not be).
        """
        fut: torch.futures.Future = torch.futures.Future()

        def job() -> None:
            try:
                fut.set_result(self(key, flat, out))
            except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
                fut.set_exception(exc)

        if self.inline:
            job()
            return fut
        if self._thread is None:
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cs3-compress")
        self._thread.submit(job)
        return fut

    def close(self) -> None:
        """Stop the communication thread (after the calls already started)."""
        if self._thread is not None:
            self._thread.shutdown(wait=True)
            self._thread = None

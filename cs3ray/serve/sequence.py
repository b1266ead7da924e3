"""A request as the engine sees it, and the text it streams back (UTF-8 and stop-string safe)."""

from __future__ import annotations

import codecs
import random
import time
from dataclasses import dataclass, field
from typing import Callable

from cs3ray.models.generate import SamplingParams


@dataclass
class Event:
    """One message from the engine to a waiting request: new text, and at the end why it stopped."""

    text: str
    finish_reason: str | None = None  # "stop", "length", "cancelled" or "error"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str | None = None


@dataclass
class GenRequest:
    """What a client asked for, already tokenized and validated."""

    prompt_ids: list[int]
    params: SamplingParams
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    emit: Callable[[Event], None] = print
    arrived: float = field(default_factory=time.perf_counter)


class Sequence:
    """A running request: its slot, position, sampler state and not-yet-sent text."""

    def __init__(self, req: GenRequest, slot: int, eos_id: int, token_bytes: list[bytes] | None = None) -> None:
        self.req = req
        # The bytes of each token id (None: the byte tokenizer's, ids 0..255): a byte-level BPE
        # token may end inside a UTF-8 character, which the incremental decoder holds back.
        self._bytes = token_bytes
        self.slot = slot
        self.eos_id = -1 if req.ignore_eos else eos_id
        self.position = 0  # next position to write in the cache
        self.generated = 0
        self.pending: int | None = None  # sampled token not yet fed back through the model
        # The request's own random stream (seeded: the same tokens whoever shares the batch).
        self.rng = random.Random(req.params.seed)
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._text = ""
        self._sent = 0
        # Text that might be the start of a stop string is held back until it cannot be.
        self._holdback = max((len(s) for s in req.stop), default=1) - 1
        self.finished: str | None = None

    def accept(self, token: int) -> None:
        """Take one sampled token: extend the text, detect stops and the length limit."""
        if token == self.eos_id:
            self.finished = "stop"
            return
        self.generated += 1
        piece = (bytes([token]) if token < 256 else b"") if self._bytes is None else (
            self._bytes[token] if 0 <= token < len(self._bytes) else b"")
        if piece:  # specials other than EOS (and ids past the tokenizer's) carry no text
            self._text += self._decoder.decode(piece)
        for stop in self.req.stop:
            cut = self._text.find(stop, max(0, self._sent - len(stop)))
            if cut >= 0:
                self._text = self._text[:cut]
                self.finished = "stop"
                return
        if self.generated >= self.req.params.max_tokens:
            self.finished = "length"
        else:
            self.pending = token

    def flush(self) -> str:
        """Text that is now safe to send (everything once finished)."""
        end = len(self._text) if self.finished else max(self._sent, len(self._text) - self._holdback)
        out, self._sent = self._text[self._sent:end], end
        return out

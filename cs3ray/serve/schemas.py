"""OpenAI-compatible request schemas (validated strictly) and response/error bodies.

Requests are pydantic models in strict mode, so `"max_tokens": "5"` is a 400 rather than a
silent coercion. Fields of the OpenAI API that this server does not implement are accepted
and ignored only when they are harmless (user, logit_bias absent...), never when they would
change the output (n > 1, logprobs, echo, penalties): those are refused with a clear message.
"""

from __future__ import annotations

import json
import sys
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from cs3ray.models import Tokenizer
from cs3ray.models.generate import SamplingParams


class APIError(Exception):
    """An error answered to the client as an OpenAI-style JSON body."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)  # not in OpenAI's API; clients pass it through extra_body
    ignore_eos: bool = False  # vLLM's extension: generate exactly max_tokens (benchmarks need fixed lengths)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=1)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: Any = None
    user: str | None = None

    @field_validator("temperature", "top_p", "presence_penalty", "frequency_penalty", mode="before")
    @classmethod
    def _int_is_a_float(cls, v: Any) -> Any:
        # JSON has one number type: 1 is as good a temperature as 1.0 (but True is not).
        return float(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("give at most 4 non-empty stop strings")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0.0:
            raise ValueError("penalties are not supported by this server; leave them at 0")
        return v

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: Any) -> Any:
        if v not in (None, False, 0):
            raise ValueError("logprobs are not supported by this server")
        return v

    def stop_list(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    def sampling(self, prompt_len: int, context: int) -> SamplingParams:
        """Sampling params with max_tokens checked against the room left in the context."""
        room = context - prompt_len
        if room <= 0:
            raise APIError(400, f"the prompt is {prompt_len} tokens but the model's context is {context} tokens; "
                                "shorten the prompt", param="prompt", code="context_length_exceeded")
        if self.max_tokens is not None and self.max_tokens > room:
            raise APIError(400, f"max_tokens={self.max_tokens} plus the {prompt_len}-token prompt exceeds the "
                                f"model's context of {context} tokens; use max_tokens <= {room}",
                           param="max_tokens", code="context_length_exceeded")
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_tokens=self.max_tokens or room, seed=self.seed)


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    echo: bool = False

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise ValueError("echo is not supported by this server")
        return v

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v: str | list[str]) -> str | list[str]:
        if isinstance(v, list) and len(v) != 1:
            raise ValueError("send exactly one prompt per request")
        return v

    def text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "user", "assistant"]
    content: str


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)


# A plain-text chat template over the byte tokenizer: the model sees a transcript, and the
# next turn header doubles as a stop string so a reply ends where the model starts a new turn.
TURN = "\n### "


def chat_prompt(messages: list[ChatMessage]) -> str:
    """The transcript a chat request is rendered to, ending with the assistant's turn header."""
    parts = [f"### {m.role.capitalize()}:\n{m.content}\n" for m in messages]
    return "".join(parts) + "### Assistant:\n"


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of a prompt; EOS first, as every training document follows an EOS."""
    # encode_batch: Hugging Face's encode holds the GIL throughout, its encode_batch releases it,
    # so a long prompt tokenized in a worker thread leaves the replica's event loop running.
    return [tokenizer.eos_id] + tokenizer.encode_batch([text])[0]


def prompt_char_limit(context: int, token_bytes: list[bytes]) -> int:
    """The longest prompt, in characters, that can fit `context` tokens: no token spans more characters
    than its longest one's bytes, so anything longer is refused without tokenizing it."""
    return context * max(1, max((len(b) for b in token_bytes), default=1))


def check_prompt_chars(text: str, limit: int, context: int, param: str) -> None:
    """A 400 for a prompt over `limit` characters (serve.max_prompt_chars), before any tokenizing."""
    if len(text) > limit:
        raise APIError(400, f"the prompt is {len(text):,} characters, above this server's limit of {limit:,} "
                            f"(serve.max_prompt_chars) for a model whose context is {context:,} tokens; "
                            "shorten the prompt", param=param, code="context_length_exceeded")


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def decode_json(raw: bytes) -> Any:
    """A request body's JSON; what json.loads would raise on hostile input (nesting deeper than the
    interpreter's stack, integers past Python's digit limit, NaN) is a 400 instead."""
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise APIError(400, "the request body nests JSON arrays or objects too deeply", code="invalid_json") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    except ValueError as exc:  # an integer past Python's digit limit, or NaN / Infinity (not JSON)
        what = (f"holds an integer of more than {sys.get_int_max_str_digits()} digits" if "integer" in str(exc)
                else f"is not valid JSON: {exc}")
        raise APIError(400, f"the request body {what}", code="invalid_json") from None


_TYPES = {"str", "int", "float", "bool", "list", "dict", "none"}


def parse(model: type[BaseModel], payload: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes one 400 naming the field."""
    if not isinstance(payload, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        err = exc.errors()[0]
        # Unions add the member type to the location ("prompt.str"); the client named only "prompt".
        field = ".".join(str(p) for p in err["loc"] if not (isinstance(p, str) and (p in _TYPES or "[" in p))) or None
        raise APIError(400, f"{field}: {err['msg']}" if field else err["msg"], param=field,
                       code="invalid_type" if "type" in err["type"] else "invalid_value") from None


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(rid: str, model: str, fingerprint: str, text: str | None, finish: str | None,
                    chunk: bool, use: dict | None = None) -> dict[str, Any]:
    """A /v1/completions response or stream chunk (text None: the final usage-only chunk)."""
    choices = [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}] if text is not None else []
    body = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body


def chat_body(rid: str, model: str, fingerprint: str, text: str | None, finish: str | None,
              chunk: bool, use: dict | None = None, first: bool = False) -> dict[str, Any]:
    """A /v1/chat/completions response or stream chunk."""
    if chunk:
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choices = [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}] if text is not None else []
        obj = "chat.completion.chunk"
    else:
        choices = [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish,
                    "logprobs": None}]
        obj = "chat.completion"
    body = {"id": rid, "object": obj, "created": int(time.time()), "model": model,
            "system_fingerprint": fingerprint, "choices": choices}
    if use is not None or not chunk:
        body["usage"] = use
    return body

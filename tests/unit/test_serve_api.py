"""Request validation, chat template and auth of the OpenAI-compatible API (no server needed)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from cs3ray.config.schema import ServeConfig
from cs3ray.models import ByteTokenizer
from cs3ray.serve.auth import check_bearer
from cs3ray.serve.schemas import APIError, ChatMessage, ChatRequest, CompletionRequest, chat_prompt, parse, prompt_ids
from cs3ray.serve.spec import ServeSpec


def bad(model, payload, param=None):
    with pytest.raises(APIError) as info:
        parse(model, payload)
    assert info.value.status == 400
    assert info.value.body()["error"]["type"] == "invalid_request_error"
    if param:
        assert info.value.param == param
    return info.value


def test_valid_completion_and_defaults():
    req = parse(CompletionRequest, {"model": "m", "prompt": "hi", "temperature": 0, "stop": "\n",
                                    "unknown_field": 1})
    assert req.temperature == 0.0 and req.stop_list() == ("\n",) and not req.stream
    p = req.sampling(prompt_len=3, context=256)
    assert p.max_tokens == 253 and p.temperature == 0.0


@pytest.mark.parametrize("payload,param", [
    ({"prompt": "a"}, "model"),
    ({"model": "m", "prompt": 5}, "prompt"),
    ({"model": "m", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "m", "prompt": "a", "max_tokens": "5"}, "max_tokens"),
    ({"model": "m", "prompt": "a", "max_tokens": 0}, "max_tokens"),
    ({"model": "m", "prompt": "a", "temperature": True}, "temperature"),
    ({"model": "m", "prompt": "a", "top_p": 1.5}, "top_p"),
    ({"model": "m", "prompt": "a", "stop": ["a", ""]}, "stop"),
    ({"model": "m", "prompt": "a", "n": 3}, "n"),
    ({"model": "m", "prompt": "a", "echo": True}, "echo"),
    ({"model": "m", "prompt": "a", "logprobs": 2}, "logprobs"),
    ({"model": "m", "prompt": "a", "presence_penalty": 0.5}, "presence_penalty"),
])
def test_invalid_completions(payload, param):
    bad(CompletionRequest, payload, param)


def test_body_must_be_an_object():
    bad(CompletionRequest, ["model", "prompt"])


def test_context_limits():
    req = parse(CompletionRequest, {"model": "m", "prompt": "a", "max_tokens": 300})
    with pytest.raises(APIError, match="max_tokens <= 254") as info:
        req.sampling(prompt_len=2, context=256)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(APIError, match="shorten the prompt"):
        parse(CompletionRequest, {"model": "m", "prompt": "a"}).sampling(prompt_len=256, context=256)


def test_chat_template_and_validation():
    req = parse(ChatRequest, {"model": "m", "messages": [{"role": "system", "content": "be brief"},
                                                         {"role": "user", "content": "hi"}]})
    text = chat_prompt(req.messages)
    assert text == "### System:\nbe brief\n### User:\nhi\n### Assistant:\n"
    assert chat_prompt([ChatMessage(role="user", content="x")]).endswith("### Assistant:\n")
    bad(ChatRequest, {"model": "m", "messages": []}, "messages")
    bad(ChatRequest, {"model": "m", "messages": [{"role": "robot", "content": "x"}]})
    bad(ChatRequest, {"model": "m", "messages": [{"role": "user", "content": 3}]})


def test_prompt_starts_with_eos_like_training_documents():
    tok = ByteTokenizer()
    assert prompt_ids(tok, "ab") == [tok.eos_id, 97, 98]


def test_bearer_auth():
    check_bearer(None, None)  # no token configured: open
    check_bearer("tok", "Bearer tok")
    check_bearer("tok", "bearer tok")
    for header in (None, "", "Bearer", "Bearer wrong", "Basic tok", "tok"):
        with pytest.raises(APIError) as info:
            check_bearer("tok", header)
        assert info.value.status == 401 and info.value.body()["error"]["code"] == "invalid_api_key"


def test_stream_pacing_stretches_under_load():
    from cs3ray.serve.pump import Pacer

    pacer = Pacer(floor_s=0.01, events_per_s=500)
    pacer.active = 2
    assert pacer.interval() == 0.01  # light load: the configured stream interval
    pacer.active = 20
    assert pacer.interval() == pytest.approx(0.04)  # 20 streams share 500 chunks/s


# --- the app over HTTP, without a cluster ------------------------------------------------------
# Hostile bodies are refused before any model runs, so nothing here depends on a dtype.

TOKEN = "tok"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class RecordingTokenizer(ByteTokenizer):
    """The byte tokenizer, noting the thread of every call."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        self.threads.append(threading.get_ident())
        return super().encode_batch(texts)


@pytest.fixture
def replica(monkeypatch):
    """An LLMServer with a tokenizer, context and limits but no engine (requests here never reach one);
    the class's routes find it as Serve's replica context would hand it to them."""
    from cs3ray.serve.app import LLMServer

    class Unloaded(LLMServer.func_or_class):
        # LLMServer's own would load a checkpoint and start the engine process, then stop it.
        async def __init__(self) -> None: ...

        def __del__(self) -> None: ...

    server = object.__new__(Unloaded)
    server.spec = ServeSpec(run="unused", name="tiny", token=TOKEN)
    server.tokenizer, server.context, server.max_prompt_chars = RecordingTokenizer(), 64, 64
    monkeypatch.setattr("ray.serve.get_replica_context", lambda: SimpleNamespace(servable_object=server))
    return server


@pytest.fixture
def http(replica):
    from cs3ray.serve.app import api

    with TestClient(api, raise_server_exceptions=False) as client:
        yield client


def error_of(response, status: int) -> dict:
    assert response.status_code == status, response.text
    err = response.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


HOSTILE = [
    ("nested arrays", b'{"model": "tiny", "prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("nested objects", b'{"a":' * 50_000 + b"1" + b"}" * 50_000),
    ("5000-digit integer", b'{"model": "tiny", "prompt": "a", "seed": ' + b"9" * 5000 + b"}"),
    ("NaN", b'{"model": "tiny", "prompt": "a", "temperature": NaN}'),
]


@pytest.mark.parametrize("body", [h[1] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_hostile_json_is_a_400_never_a_500(http, replica, path, body):
    err = error_of(http.post(path, content=body, headers=AUTH), 400)
    assert err["type"] == "invalid_request_error" and err["code"] == "invalid_json"
    assert "sys." not in err["message"]  # what the client can change, not the server's interpreter
    assert not replica.tokenizer.threads


def test_unknown_model_is_a_404_in_openais_shape(http):
    for path, body in (("/v1/completions", {"model": "gpt-9", "prompt": "a"}),
                       ("/v1/chat/completions", {"model": "gpt-9", "messages": [{"role": "user", "content": "a"}]})):
        err = error_of(http.post(path, json=body, headers=AUTH), 404)
        assert err == {"message": err["message"], "type": "invalid_request_error", "param": "model",
                       "code": "model_not_found"}
        assert "'gpt-9'" in err["message"] and "'tiny'" in err["message"]


def test_a_prompt_over_the_limit_is_refused_before_tokenizing(http, replica):
    err = error_of(http.post("/v1/completions", json={"model": "tiny", "prompt": "x" * 65}, headers=AUTH), 400)
    assert "65 characters" in err["message"] and "64" in err["message"] and "serve.max_prompt_chars" in err["message"]
    assert err["param"] == "prompt" and err["code"] == "context_length_exceeded"
    long_chat = {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40}] * 2}
    assert error_of(http.post("/v1/chat/completions", json=long_chat, headers=AUTH), 400)["param"] == "messages"
    assert not replica.tokenizer.threads  # refused on its length alone


def test_prompts_are_tokenized_off_the_event_loop(replica):
    from cs3ray.serve.schemas import CompletionRequest

    async def one() -> tuple[list[int], int]:
        req = parse(CompletionRequest, {"model": "tiny", "prompt": "x" * 10, "max_tokens": 4})
        gen = await replica._request(req, req.text(), (), "prompt")
        return gen.prompt_ids, threading.get_ident()
    ids, loop_thread = asyncio.run(one())
    assert ids == prompt_ids(ByteTokenizer(), "x" * 10)
    assert replica.tokenizer.threads and loop_thread not in replica.tokenizer.threads


def test_the_default_prompt_limit_is_where_no_prompt_can_fit():
    from cs3ray.serve.schemas import prompt_char_limit

    assert prompt_char_limit(256, ByteTokenizer().token_bytes()) == 256  # one byte a token at most
    assert prompt_char_limit(1024, [b"a", b"", b"abcdefgh", b"\xe2\x82"]) == 8 * 1024
    assert ServeConfig().max_prompt_chars is None  # derived per model, in the replica


def test_openapi_needs_the_token_and_there_are_no_docs_pages(http):
    error_of(http.get("/openapi.json"), 401)
    error_of(http.get("/openapi.json", headers={"Authorization": "Bearer wrong"}), 401)
    paths = http.get("/openapi.json", headers=AUTH).json()["paths"]
    assert {"/v1/models", "/v1/completions", "/v1/chat/completions"} <= set(paths)
    for page in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert error_of(http.get(page, headers=AUTH), 404)["code"] == "not_found"


def test_serve_queues_a_bounded_number_of_requests(tmp_path):
    from cs3ray.serve.deploy import build_app, make_spec

    from helpers.serve_checkpoints import make_checkpoint

    assert ServeConfig().max_queued_requests >= 1  # never Serve's -1 (no bound)
    make_checkpoint(tmp_path / "run")
    spec = make_spec(str(tmp_path / "run"), overrides={"max_queued_requests": 3})
    assert build_app(spec)._bound_deployment._deployment_config.max_queued_requests == 3
    # A retiring replica that has nothing in flight goes at once, not after Serve's 2 s first wait.
    assert build_app(spec)._bound_deployment._deployment_config.graceful_shutdown_wait_loop_s == 0.2

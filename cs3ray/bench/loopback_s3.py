"""A stand-in for remote object storage on 127.0.0.1: moto's S3 server plus a latency/outage proxy.

The proxy sits between an S3 client (s3fs, exactly as a user configures it) and the moto
server: it waits `latency_s` before forwarding each request, as a far-away store would, and
while `down` is set answers every request with 503, which is how tests stage an outage;
`outage_from(match, seconds)` starts one at an exact request (not at a moment that races the client).
`ProxyProcess` runs the same proxy in a process of its own (`python -m cs3ray.bench.loopback_s3 UPSTREAM
LATENCY_S`), so that a bench can read its CPU time apart from the client's and it takes no GIL from it.
"""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import threading
import time
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

from cs3ray.ops.ports import free_port

STATS_PATH = "/__cs3-proxy-stats"  # answered by the proxy itself (its request count), never forwarded
HOP_HEADERS = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "upgrade", "te"}


class MotoServer:
    """`python -m moto.server` in a subprocess; `options()` are s3fs storage options for it."""

    def __init__(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(200):
            try:
                urllib.request.urlopen(self.url, timeout=1)
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None:
                    break
                time.sleep(0.1)
        self.stop()
        raise RuntimeError("moto server did not start (is moto[server] installed?)")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


def s3_options(endpoint_url: str) -> dict:
    """Storage options that reach an S3 endpoint at `endpoint_url` with moto's test keys."""
    return {"key": "testing", "secret": "testing",
            "client_kwargs": {"endpoint_url": endpoint_url, "region_name": "us-east-1"}}


def make_bucket(endpoint_url: str, bucket: str) -> None:
    """Create `bucket` (no LocationConstraint: moto refuses one naming us-east-1)."""
    import s3fs

    fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": endpoint_url},
                           skip_instance_cache=True)
    if not fs.exists(bucket):
        fs.mkdir(bucket)


class LatencyProxy:
    """A threaded HTTP proxy to `upstream` that adds latency per request and can play dead."""

    def __init__(self, upstream: str, latency_s: float = 0.02) -> None:
        self.latency_s, self.down, self.requests = latency_s, False, 0
        self._trigger: tuple[str, float] | None = None
        self._down_until = 0.0
        parts = urlsplit(upstream)
        host, port = parts.hostname, parts.port
        local = threading.local()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def _forward(self) -> None:
                if self.path == STATS_PATH:
                    msg = json.dumps({"requests": proxy.requests}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    self.wfile.write(msg)
                    return
                proxy.requests += 1
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else None
                time.sleep(proxy.latency_s)
                trigger = proxy._trigger
                if trigger is not None and trigger[0] in self.path:
                    proxy._trigger, proxy._down_until = None, time.monotonic() + trigger[1]
                if proxy.down or time.monotonic() < proxy._down_until:
                    msg = b"<Error><Code>ServiceUnavailable</Code><Message>injected outage</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(msg)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(msg)
                    return
                conn = getattr(local, "conn", None)
                if conn is None:
                    conn = local.conn = http.client.HTTPConnection(host, port, timeout=60)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in HOP_HEADERS}
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                except (OSError, http.client.HTTPException):
                    local.conn = None
                    raise
                self.send_response(resp.status)
                head = self.command == "HEAD"  # a HEAD's Content-Length is the object's size: keep it
                for k, v in resp.getheaders():
                    if k.lower() not in HOP_HEADERS and (head or k.lower() != "content-length"):
                        self.send_header(k, v)
                if not head:
                    self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True, name="cs3-s3-proxy")
        self._thread.start()

    def outage_from(self, match: str, seconds: float) -> None:
        """Answer 503 for `seconds` from the next request whose path contains `match` (that one included)."""
        self._trigger = (match, seconds)

    def outage_over(self) -> bool:
        """True once an outage set by `outage_from` has started and ended."""
        return self._trigger is None and time.monotonic() >= self._down_until

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class ProxyProcess:
    """A LatencyProxy to `upstream` in a subprocess: `url`, `requests` (so far) and `pid` (for its CPU time)."""

    def __init__(self, upstream: str, latency_s: float = 0.02) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, upstream, repr(latency_s)],
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        self.pid = self.proc.pid
        line = self.proc.stdout.readline().strip() if self.proc.stdout else ""  # its URL, once it listens
        if not line.startswith("http://"):
            self.stop()
            raise RuntimeError("the S3 latency proxy process did not start")
        self.url = line

    @property
    def requests(self) -> int:
        with urllib.request.urlopen(self.url + STATS_PATH, timeout=10) as resp:
            return int(json.loads(resp.read())["requests"])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
        if self.proc.stdout:
            self.proc.stdout.close()


def main(argv: list[str]) -> None:
    """`python -m cs3ray.bench.loopback_s3 UPSTREAM LATENCY_S`: serve until terminated, the URL on stdout."""
    proxy = LatencyProxy(argv[0], float(argv[1]))
    print(proxy.url, flush=True)
    threading.Event().wait()


if __name__ == "__main__":
    main(sys.argv[1:])

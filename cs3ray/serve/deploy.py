"""Deploy, run in the foreground and shut down a cs3ray Serve application."""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import ssl
import threading
from pathlib import Path
from typing import Any, Callable

import yaml
from pydantic import ValidationError

from cs3ray.ckpt import open_checkpoint
from cs3ray.ckpt.manifest import MANIFEST
from cs3ray.config import resolve_run, stored_config
from cs3ray.config.schema import ServeConfig
from cs3ray.errors import UserError
from cs3ray.models.factory import require_trust
from cs3ray.ops.cluster_env import HAPROXY_SWITCH
from cs3ray.ops.json_logs import serve_logging_config
from cs3ray.storage import is_remote, open_url

from .spec import ServeSpec
from .tuning import replica_actor_options
from .vllm_engine import require_vllm, vllm_installed


def is_loopback(host: str) -> bool:
    """Whether `host` is an interface only this machine reaches: 127.0.0.0/8, ::1 or localhost."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # any other name may resolve to an outside interface


def check_exposure(host: str, token: str | None, insecure: bool = False) -> None:
    """Refuse an API without a token on an interface other machines reach, unless the user said --insecure."""
    if token is None and not insecure and not is_loopback(host):
        raise UserError(f"refusing to serve an API without a token on {host}, which is not a loopback interface: "
                        "set --token-file or CS3_SERVE_TOKEN, or pass --insecure to serve it open.")


def read_token_file(path: str) -> str:
    """The API token kept in the file at `path` (surrounding whitespace dropped): it stays out of `ps`."""
    try:
        token = Path(path).expanduser().read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read the token file '{path}': {getattr(exc, 'strerror', None) or exc}.") from None
    if not token:
        raise UserError(f"the token file '{path}' is empty; write the token into it.")
    return token


def pick_token(token: str | None, token_file: str | None) -> str | None:
    """The API token from --token / CS3_SERVE_TOKEN or --token-file (never both)."""
    if token is not None and token_file is not None:
        raise UserError("--token-file and --token (or CS3_SERVE_TOKEN) both give a token; keep one of them.")
    return read_token_file(token_file) if token_file is not None else token


def check_tls(cert: str | None, key: str | None) -> tuple[str, str] | None:
    """Absolute paths of a certificate and key that belong together, or None for plain HTTP."""
    if not cert and not key:
        return None
    if not cert or not key:
        raise UserError("TLS needs both --tls-cert and --tls-key (serve.tls_cert and serve.tls_key).")
    cert, key = os.path.abspath(os.path.expanduser(cert)), os.path.abspath(os.path.expanduser(key))
    for path in (cert, key):
        if not os.path.isfile(path):
            raise UserError(f"TLS file '{path}' does not exist.")
    try:  # here, not as a proxy that never starts
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        reason = getattr(exc, "reason", None)
        why = ("the key does not belong to the certificate" if reason == "KEY_VALUES_MISMATCH" else
               "they are not a PEM certificate and its unencrypted private key" if isinstance(exc, ssl.SSLError)
               else exc.strerror or str(exc))
        raise UserError(f"cannot use TLS certificate '{cert}' with key '{key}': {why}.") from None
    return cert, key


def check_tls_ingress() -> None:
    """Refuse TLS where HAProxy takes HTTP: Ray 2.60's HAProxy template has no TLS lines."""
    if os.environ.get(HAPROXY_SWITCH) == "1":
        raise UserError("TLS is served by Serve's own proxy: Ray 2.60's HAProxy ingress has no TLS; "
                        "leave out --haproxy (RAY_SERVE_ENABLE_HA_PROXY=1).")


def make_spec(run: str, name: str | None = None, token: str | None = None, follow: bool = False,
              overrides: dict[str, Any] | None = None, storage_options: dict | None = None,
              route_prefix: str = "/", host: str = "127.0.0.1", insecure: bool = False,
              trust_code: bool = False, ckpt_replicas: list[str] | None = None,
              stored_replicas: bool = False, log_format: str | None = None) -> ServeSpec:
    """What `cs3 serve` and jobs/serve.py share before any Ray: refuse an open API on a non-loopback
    `host`, check the checkpoint is there and read its serve section (the command's values on top).
    log_format: 'text' or 'json' replica logs; by default the run.log_format the checkpoint was trained with."""
    if log_format not in (None, "text", "json"):
        raise UserError(f"--log-format must be text or json, not '{log_format}'.")
    if token is not None and not token.strip():
        raise UserError("--token is empty; give a non-empty token or leave the option out.")
    check_exposure(host, token, insecure)
    url = resolve_run(run)
    if not is_remote(url):
        url = os.path.abspath(url)  # replicas run in other working directories
    ckpt = open_checkpoint(url, storage_options, replicas=ckpt_replicas or [],  # the one the replicas will load
                           stored_replicas=stored_replicas)
    if follow and open_url(url, storage_options).exists(MANIFEST):
        raise UserError(f"--follow needs a run directory to watch, but '{run}' is one checkpoint folder.")
    cfg = stored_config(yaml.safe_load(ckpt.read("config.yaml")), source=f"{ckpt.url}/config.yaml")
    require_trust(cfg, trust_code, f"checkpoint '{ckpt.url}'")  # here, not first in every replica
    serve_cfg = resolve_engine(merged_serve(cfg.serve, overrides), cfg.model.target)
    check_engine(serve_cfg, cfg.model.target)
    if (tls := check_tls(serve_cfg.tls_cert, serve_cfg.tls_key)) is not None:
        serve_cfg = serve_cfg.model_copy(update={"tls_cert": tls[0], "tls_key": tls[1]})  # the proxy's cwd differs
    name = name or cfg.run.name
    return ServeSpec(run=url, name=name, serve=serve_cfg, token=token, follow=follow,
                     storage_options=storage_options, route_prefix=route_prefix, insecure=insecure,
                     trust_code=trust_code, ckpt_replicas=list(ckpt_replicas or []), stored_replicas=stored_replicas,
                     log_format=log_format or cfg.run.log_format, run_name=cfg.run.name)


def merged_serve(stored: ServeConfig, overrides: dict[str, Any] | None) -> ServeConfig:
    """A checkpoint's serve section with the command's values on top (None: not given), checked."""
    values = stored.model_dump() | {k: v for k, v in (overrides or {}).items() if v is not None}
    try:
        return type(stored).model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(map(str, err["loc"]))
        shown = json.dumps(err.get("input"), default=lambda v: type(v).__name__)
        raise UserError(f"serve.{where}={shown} is invalid: {err['msg']}.") from None


def resolve_engine(serve_cfg: ServeConfig, model_target: str | None) -> ServeConfig:
    """serve.engine=auto as the engine it picks: vLLM where it is installed and serves the model (cs3ray's own
    transformer), else the built-in engine, which needs nothing more (why: docs/design.md, vLLM as the peer)."""
    if serve_cfg.engine != "auto":
        return serve_cfg
    engine = "vllm" if vllm_installed() and not model_target else "builtin"
    return serve_cfg.model_copy(update={"engine": engine})


def check_engine(serve_cfg: ServeConfig, model_target: str | None) -> None:
    """Refuse an engine choice that cannot serve this checkpoint, before any cluster or replica starts."""
    if serve_cfg.engine != "vllm":
        if serve_cfg.tp * serve_cfg.pp > 1:
            raise UserError(f"serve.tp={serve_cfg.tp} and serve.pp={serve_cfg.pp} split a model across devices with "
                            "serve.engine=vllm; the built-in engine holds the whole model in each replica.")
        return
    require_vllm()
    if model_target:
        raise UserError(f"serve.engine=vllm serves cs3ray's built-in transformer through its Hugging Face export; this "
                        f"checkpoint's model is model.target '{model_target}': use serve.engine=builtin.")


def placement(s: ServeConfig) -> dict[str, Any]:
    """Deployment options that place a vLLM replica split over serve.tp x serve.pp devices: a bundle for the
    replica itself and one per vLLM worker (a GPU each, or a CPU on CPU hosts), packed onto as few nodes as
    hold them; vLLM's Ray executor starts its workers in these bundles."""
    workers = s.tp * s.pp
    if s.engine != "vllm" or workers == 1:
        return {}
    device = {"GPU": 1} if s.num_gpus > 0 else {"CPU": 1}
    return {"placement_group_bundles": [{"CPU": s.num_cpus}] + [device] * workers,
            "placement_group_strategy": "PACK"}


GRACEFUL_SHUTDOWN_POLL_S = 0.2


def build_app(spec: ServeSpec):
    """The Serve application for `spec`: replica resources and autoscaling from its serve section."""
    from .app import LLMServer

    s = spec.serve
    split = placement(s)  # a split replica's GPUs are its workers', in their bundles
    options: dict[str, Any] = {"ray_actor_options": replica_actor_options({"num_cpus": s.num_cpus,
                                                                            "num_gpus": 0 if split else s.num_gpus}),
                               **split,
                               "max_ongoing_requests": s.max_ongoing_requests,
                               # Bounded: past it Serve answers 503 at once (its default queues forever).
                               "max_queued_requests": s.max_queued_requests,
                               # A stream in flight finishes before its replica is retired.
                               "graceful_shutdown_timeout_s": s.request_timeout_s,
                               # How often a retiring replica looks for requests still in flight. Serve's 2 s
                               # is also what an idle replica sleeps before its first look, on every stop,
                               # redeploy and scale-down; a count of requests is cheap to take 5 times a second.
                               "graceful_shutdown_wait_loop_s": GRACEFUL_SHUTDOWN_POLL_S}
    if s.min_replicas is not None and s.max_replicas is not None:
        if s.min_replicas > s.max_replicas:
            raise UserError(f"serve.min_replicas={s.min_replicas} is above serve.max_replicas={s.max_replicas}.")
        options["autoscaling_config"] = {"min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                                         "initial_replicas": max(1, s.min_replicas),
                                         "target_ongoing_requests": s.target_ongoing_requests,
                                         **spec.autoscaling_options}
    else:
        options["num_replicas"] = s.replicas
    if (logging_config := serve_logging_config(spec.log_format)) is not None:
        options["logging_config"] = logging_config  # Serve's replica files in JSON (ops.json_logs)
    return LLMServer.options(name=f"{spec.name}-llm", **options).bind(spec)


def start_serve(http_options: dict[str, Any]):
    """Start Serve with `http_options` unless it runs already; the HTTP options its proxies run with."""
    from ray import serve
    from ray.serve.context import _get_global_client

    # A running Serve keeps its own options (serve.start would only log that it ignores ours).
    client = _get_global_client(raise_if_no_controller_running=False)
    if client is None:
        serve.start(http_options=http_options)
        client = _get_global_client()
    return client.http_config


def check_bound(spec: ServeSpec, bound, port: int) -> str:
    """Refuse to deploy behind a proxy that listens wider, or with less TLS, than `spec` allows; its base URL."""
    host = bound.host
    if host is None:
        raise UserError("Serve on this cluster runs without an HTTP proxy (http_options.host is None).")
    started = "Serve on this cluster was started with these HTTP options, and a running Serve keeps its own"
    if spec.token is None and not spec.insecure and not is_loopback(host):
        raise UserError(f"refusing to deploy an API without a token: {started}, so it listens on {host}:{bound.port}, "
                        "not a loopback interface; set --token-file or CS3_SERVE_TOKEN (or --insecure to serve it open).")
    tls = bool(bound.ssl_certfile and bound.ssl_keyfile)
    if spec.serve.tls_cert and not tls:
        raise UserError(f"refusing to deploy without TLS: {started}, and they have no ssl_certfile/ssl_keyfile.")
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    shown = f"[{shown}]" if ":" in shown else shown
    return f"{'https' if tls else 'http'}://{shown}:{bound.port}{spec.route_prefix.rstrip('/')}"


def deploy(spec: ServeSpec, host: str = "127.0.0.1", port: int = 8000) -> str:
    """Start Serve's HTTP proxy (if needed) and run the app; returns its base URL once healthy.

    A cluster where Serve already runs keeps its proxies' HTTP options, whatever was asked: the
    exposure is checked on those, before anything is deployed."""
    from ray import serve

    check_exposure(host, spec.token, spec.insecure)  # also for callers that built the spec themselves
    http_options: dict[str, Any] = {"host": host, "port": port}
    if spec.serve.tls_cert:
        check_tls_ingress()
        http_options |= {"ssl_certfile": spec.serve.tls_cert, "ssl_keyfile": spec.serve.tls_key}
    url = check_bound(spec, start_serve(http_options), port)
    app = build_app(spec)
    try:
        serve.run(app, name=spec.name, route_prefix=spec.route_prefix, blocking=False)
    except BaseException as exc:
        shutdown(spec.name)  # what did start of it
        if not isinstance(exc, RuntimeError):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(f"application '{spec.name}' failed to start: {first}") from None
    return url


def shutdown(name: str) -> None:
    """Delete one application (others on the cluster keep running)."""
    from ray import serve

    serve.delete(name, _blocking=True)


def stop(name: str) -> None:
    """Delete the application `name` from the connected cluster (`cs3 serve stop`); others keep running."""
    from ray import serve

    apps = serve.status().applications
    if name not in apps:
        running = ", ".join(sorted(apps)) or "none"
        raise UserError(f"no Serve application named '{name}' on this cluster (running: {running}).")
    shutdown(name)


def serve_foreground(spec: ServeSpec, host: str, port: int, on_ready: Callable[[str], None] = print) -> None:
    """Deploy, wait for Ctrl-C (SIGINT) or SIGTERM, then delete the app."""
    stop = threading.Event()
    # Handlers for both: a process started in the background by a shell ignores SIGINT by
    # default, and `ray job stop` / Kubernetes send SIGTERM.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        url = deploy(spec, host, port)  # a refusal or a failed start leaves nothing deployed
        try:
            on_ready(url)
            while not stop.wait(0.2):
                pass
        finally:
            shutdown(spec.name)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

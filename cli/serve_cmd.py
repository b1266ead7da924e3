"""`cs3 serve`: an OpenAI-compatible Ray Serve application over a run's newest checkpoint.

`cs3 serve RUN` serves until Ctrl-C; `--detach` leaves the app on a running cluster, and
`cs3 serve stop --name APP --address ADDR` deletes it later.
"""

from __future__ import annotations

import os
from typing import Optional

import typer

from cs3ray.errors import UserError
from cs3ray.ops.cluster_env import HAPROXY_SWITCH, haproxy_binary
from cs3ray.ops.cluster_record import recorded_cluster

from .common import (
    AddressOpt,
    ReplicaOpt,
    ServeOverridesArg,
    StorageOptionsOpt,
    StoredReplicasOpt,
    console,
    user_errors,
)

STOP = "stop"


@user_errors
def serve(run: str = typer.Argument(..., help="Run name (under runs/), run directory or checkpoint folder/URL; "
                                              "or 'stop' to delete the app named by --name (a run called "
                                              "stop: runs/stop)."),
          storage: Optional[list[str]] = ServeOverridesArg,
          port: int = typer.Option(8000, min=1, max=65535, help="HTTP port of Serve's proxy."),
          host: str = typer.Option("127.0.0.1", help="Interface to listen on (0.0.0.0 for every interface)."),
          replicas: Optional[int] = typer.Option(None, min=1, help="Replicas (default: serve.replicas of the config)."),
          token: Optional[str] = typer.Option(None, envvar="CS3_SERVE_TOKEN", show_envvar=True,
                                              help="Require 'Authorization: Bearer TOKEN' on the API. An argument "
                                                   "shows in `ps` to every user of the machine: for local use; "
                                                   "else --token-file or CS3_SERVE_TOKEN."),
          token_file: Optional[str] = typer.Option(None, "--token-file", help="Read the API token from this file "
                                                                                "(e.g. a mounted secret)."),
          tls_cert: Optional[str] = typer.Option(None, "--tls-cert", help="Serve HTTPS with this PEM certificate "
                                                                          "(chain); needs --tls-key."),
          tls_key: Optional[str] = typer.Option(None, "--tls-key", help="PEM private key of --tls-cert."),
          haproxy: bool = typer.Option(False, "--haproxy", help="Own cluster: Serve's HAProxy ingress in place of its "
                                                                "Python proxy (faster streaming; no TLS, stats and "
                                                                "metrics ports on every interface)."),
          insecure: bool = typer.Option(False, "--insecure", help="Serve an open API (no token) on a non-loopback "
                                                                  "--host: anyone who reaches it can use it."),
          trust_code: bool = typer.Option(False, "--trust-code", help="Import and run the model.target code the "
                                                                      "checkpoint's config names."),
          name: Optional[str] = typer.Option(None, help="Application name and model id (default: the run's name)."),
          dtype: Optional[str] = typer.Option(None, help="Inference precision: auto, bf16, fp16 or fp32."),
          max_batch: Optional[int] = typer.Option(None, min=1, help="Sequences batched together (1: no batching)."),
          follow: bool = typer.Option(False, "--follow", help="Hot-reload newer checkpoints of RUN as training writes them."),
          log_format: Optional[str] = typer.Option(None, "--log-format", help="Replica logs: text or json (one JSON "
                                                                               "object per line; default: the run's "
                                                                               "run.log_format)."),
          detach: bool = typer.Option(False, "--detach", help="Leave the app running on the remote cluster and exit."),
          ckpt_replica: Optional[list[str]] = ReplicaOpt, use_stored_replicas: bool = StoredReplicasOpt,
          address: Optional[str] = AddressOpt,
          storage_options: Optional[str] = StorageOptionsOpt) -> None:
    """Serve RUN's newest checkpoint with an OpenAI-compatible API until Ctrl-C / SIGTERM."""
    from cs3ray.config import runtime_serve_options
    from cs3ray.serve.deploy import check_tls_ingress, make_spec, pick_token
    from cs3ray.serve.launch import run_app

    if run == STOP:
        stop_app(name, address)
        return
    if haproxy:
        use_haproxy(address)
    options, values = runtime_serve_options(storage or [], storage_options)
    given = {"replicas": replicas, "dtype": dtype, "max_batch": max_batch, "tls_cert": tls_cert, "tls_key": tls_key}
    spec = make_spec(run, name=name, token=pick_token(token, token_file), follow=follow, host=host,
                     insecure=insecure, trust_code=trust_code,
                     overrides=values | {k: v for k, v in given.items() if v is not None},  # the options win
                     storage_options=options,
                     ckpt_replicas=ckpt_replica or [], stored_replicas=use_stored_replicas, log_format=log_format)
    if spec.serve.tls_cert:
        check_tls_ingress()  # before a cluster starts

    def ready(url: str) -> None:
        auth = "bearer token required" if spec.token else "no auth"
        console.print(f"serving [bold]{spec.name}[/] at {url}/v1 ({auth}); Ctrl-C to stop", highlight=False)

    served = run_app(spec, host, port, address=address, detach=detach, on_ready=ready)
    if detach:
        console.print(f"deployed [bold]{spec.name}[/] at {served.url}/v1; stop it with "
                      f"`cs3 serve stop --name {spec.name} --address {served.address}`", highlight=False, soft_wrap=True)
        return
    console.print("stopped", highlight=False)


def use_haproxy(address: Optional[str]) -> None:
    """--haproxy: the embedded cluster runs Serve's HAProxy ingress (a running cluster has its own)."""
    if address or os.environ.get("RAY_ADDRESS") or recorded_cluster() is not None:
        raise UserError("--haproxy is for the cluster cs3 serve starts; a running cluster's ingress is set where it "
                        "starts (RAY_SERVE_ENABLE_HA_PROXY=1 on every node).")
    if haproxy_binary() is None:
        raise UserError("--haproxy needs an HAProxy binary: install ray[serve] (it bundles one on Linux) or haproxy.")
    os.environ[HAPROXY_SWITCH] = "1"


def stop_app(name: Optional[str], address: Optional[str]) -> None:
    """`cs3 serve stop`: delete a (detached) application from a running cluster."""
    from cs3ray.serve.launch import delete_app

    if not name:
        raise UserError("cs3 serve stop needs --name APP: the application to delete.")
    if not address:
        raise UserError("cs3 serve stop needs --address (or RAY_ADDRESS): the cluster the app runs on.")
    delete_app(name, address)
    console.print(f"stopped [bold]{name}[/]", highlight=False)

"""`cs3 submit` and `cs3 jobs ls|status|logs|stop`: training runs as Ray jobs on a (remote) cluster."""

from __future__ import annotations

import json
import os
import sys
from typing import TYPE_CHECKING, Optional

import typer
from rich.table import Table

from cs3ray.errors import UserError

from .common import JsonOpt, OverridesArg, console, err_console, fail, note, overrides_list, user_errors

if TYPE_CHECKING:
    from cs3ray.ops import jobs

DashboardOpt = typer.Option(None, "--address", envvar="RAY_ADDRESS",
                            help="The cluster's dashboard URL (http://HEAD:8265), as for `ray job submit`; a cluster "
                                 "address (HEAD:6379) is resolved to it.")
EnvOpt = typer.Option(None, "--env", help="KEY or KEY=VALUE to set in the job (repeatable; KEY alone takes this "
                                          "shell's value). Not for credentials: `ray job list` shows them; the "
                                          "cluster's own chain gives them.")
PipOpt = typer.Option(None, "--pip", help="Extra pip package for the job (repeatable).")
RawOpt = typer.Option(False, "--raw", help="Print the job's output as it is (its JSON event lines), not as "
                                            "`cs3 train` shows progress.")
app = typer.Typer(help="Ray jobs on a cluster: list, status, logs, stop.", no_args_is_help=True)


def _dashboard(address: Optional[str]) -> jobs.Dashboard:
    from cs3ray.ops import jobs

    dashboard = jobs.resolve_dashboard(address)
    err_console.print(f"using {dashboard.how}", highlight=False)
    return dashboard


def _env_vars(values: list[str]) -> dict[str, str]:
    out = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep:
            if key not in os.environ:
                raise UserError(f"--env {key}: no such variable in this environment (or give KEY=VALUE).")
            value = os.environ[key]
        out[key] = value
    return out


def _follow(dashboard: jobs.Dashboard, job_id: str, raw: bool) -> None:
    """Follow the job's log to its end through dropped streams; exit 0 if it succeeded, else 1."""
    from cs3ray.ops import job_follow

    from .job_lines import Renderer

    render = Renderer(lambda text: (sys.stdout.write(text), sys.stdout.flush()), raw=raw)
    try:
        status = job_follow.follow(dashboard, job_id, render, note)
    except KeyboardInterrupt:
        err_console.print(f"stopped following; job {job_id} keeps running (`cs3 jobs stop {job_id}`)")
        raise typer.Exit(130) from None
    finally:
        render.close()
    if status != "SUCCEEDED":
        fail(f"job {job_id} ended {status}", 1)
    err_console.print(f"job {job_id} succeeded", highlight=False)


def _shown(info: dict) -> dict:
    # Jobs submitted by other means (`ray job submit`) may carry a credential in their entrypoint.
    from cs3ray.ops import job_credentials

    return {**info, "entrypoint": job_credentials.redact_entrypoint(info["entrypoint"] or "")}


@user_errors
def submit(config: str = typer.Argument(..., help="YAML job config, inside the working dir."),
           overrides: Optional[list[str]] = OverridesArg,
           address: Optional[str] = DashboardOpt,
           working_dir: str = typer.Option(".", "--working-dir", help="Uploaded as the job's working dir "
                                                                      "(.gitignore and .rayignore honoured)."),
           name: Optional[str] = typer.Option(None, "--name", help="Run name (overrides run.name)."),
           no_wait: bool = typer.Option(False, "--no-wait", help="Return once submitted; do not follow the logs."),
           raw: bool = RawOpt,
           env: Optional[list[str]] = EnvOpt, pip: Optional[list[str]] = PipOpt,
           resume: bool = typer.Option(False, "--resume", help="Continue the run from its newest checkpoint."),
           overwrite: bool = typer.Option(False, "--overwrite", help="Start the run over.")) -> None:
    """Submit a training run as a Ray job and follow its logs until it ends (exit 1 if it fails or is stopped).
    With --name, a run of that name already pending or running on the cluster is an error, not a second job."""
    from cs3ray.config import load_config
    from cs3ray.ops import job_credentials, jobs

    root = os.path.abspath(working_dir)
    if not os.path.isdir(root):
        raise UserError(f"--working-dir '{working_dir}' is not a directory.")
    rel = os.path.relpath(os.path.abspath(config), root)
    if rel.startswith(".."):
        raise UserError(f"config '{config}' is outside --working-dir '{working_dir}': the job only sees that folder.")
    extra = overrides_list(overrides) + ([f"run.name={name}"] if name else [])
    env_vars = _env_vars(env or [])
    # Refused, not redacted: the job needs the value, and where it would go (entrypoint, runtime_env,
    # the uploaded config file) is stored and shown by the cluster; the backend's chain there is safe.
    job_credentials.check_overrides(extra)
    job_credentials.check_config_file(config)
    job_credentials.check_env_vars(env_vars)
    cfg = load_config(config, extra)  # a bad config is refused here, not on the cluster
    dashboard = _dashboard(address)
    run_dir, warning = jobs.run_dir_override(cfg, dashboard, os.getcwd())
    if warning:
        err_console.print(f"[yellow]warning:[/] {warning}", highlight=False)
    flags = ["--resume"] * resume + ["--overwrite"] * overwrite
    if name and (running := jobs.active_job_of_run(dashboard, cfg.run.name)):
        raise UserError(f"run '{cfg.run.name}' is already being trained by job {running}: follow it with "
                        f"`cs3 jobs logs {running} -f`, or stop it with `cs3 jobs stop {running}` first.")
    job_id = jobs.submit(dashboard, rel, extra + run_dir, root, env_vars, list(pip or []), flags, cfg.run.name)
    err_console.print(f"submitted job {job_id} (run '{cfg.run.name}'); `cs3 jobs logs {job_id} --follow`, "
                      f"`cs3 jobs stop {job_id}`", highlight=False)
    if no_wait:
        print(job_id)
        return
    _follow(dashboard, job_id, raw)


@app.command("ls")
@user_errors
def ls(address: Optional[str] = DashboardOpt, as_json: bool = JsonOpt) -> None:
    """Jobs on the cluster, newest first."""
    from cs3ray.ops import jobs

    dashboard = _dashboard(address)
    client = jobs.client(dashboard)
    listed = sorted((_shown(jobs.describe(j)) for j in jobs.call(dashboard, client.list_jobs)),
                    key=lambda j: j["start_time"] or 0, reverse=True)
    table = Table("id", "status", "entrypoint", title=f"jobs on {dashboard.url}")
    for j in listed:
        table.add_row(j["id"], j["status"], j["entrypoint"][:80])
    (err_console if as_json else console).print(table)
    if as_json:
        print(json.dumps(listed))


@app.command("status")
@user_errors
def status(job_id: str = typer.Argument(..., help="Job id (from `cs3 submit` or `cs3 jobs ls`)."),
           address: Optional[str] = DashboardOpt, as_json: bool = JsonOpt) -> None:
    """One job's status and message."""
    from cs3ray.ops import jobs

    dashboard = _dashboard(address)
    client = jobs.client(dashboard)
    info = _shown(jobs.describe(jobs.call(dashboard, lambda: client.get_job_info(job_id))))
    if as_json:
        print(json.dumps(info))
    else:
        console.print(f"{info['id']}: {info['status']}" + (f" ({info['message']})" if info["message"] else ""),
                      highlight=False)


@app.command("logs")
@user_errors
def logs(job_id: str = typer.Argument(..., help="Job id."), address: Optional[str] = DashboardOpt,
         follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing until the job ends (through "
                                     "dropped connections), then exit 0 if it succeeded, 1 if it failed or was "
                                     "stopped."),
         raw: bool = RawOpt) -> None:
    """A job's logs so far (or, with --follow, until it ends)."""
    from cs3ray.ops import jobs

    from .job_lines import Renderer

    dashboard = _dashboard(address)
    if follow:
        _follow(dashboard, job_id, raw)
        return
    client = jobs.client(dashboard)
    render = Renderer(sys.stdout.write, raw=raw)
    render(jobs.call(dashboard, lambda: client.get_job_logs(job_id)))
    render.close()


@app.command("stop")
@user_errors
def stop(job_id: str = typer.Argument(..., help="Job id."), address: Optional[str] = DashboardOpt) -> None:
    """Ask a running job to stop (Ray sends it SIGTERM, then SIGKILL)."""
    from cs3ray.ops import jobs

    dashboard = _dashboard(address)
    client = jobs.client(dashboard)
    stopped = jobs.call(dashboard, lambda: client.stop_job(job_id))
    console.print(f"job {job_id}: " + ("stop requested" if stopped else "was not running"), highlight=False)

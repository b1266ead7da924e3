"""The Ray job entry points (jobs/*.py) take the options of the `cs3` commands they mirror."""

from __future__ import annotations

import importlib.util
import re

import pytest
import typer.main

from cs3ray_cli.main import app

from conftest import ROOT


def job_options(name: str, capsys) -> set[str]:
    """The long options jobs/NAME.py lists in its --help."""
    spec = importlib.util.spec_from_file_location(f"jobs_{name}", ROOT / "jobs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(SystemExit):
        module.main(["--help"])
    return set(re.findall(r"(--[a-z][a-z-]*)", capsys.readouterr().out))


def test_jobs_train_takes_every_option_of_cs3_train(capsys):
    command = typer.main.get_command(app).commands["train"]
    cli = {opt for p in command.params for opt in p.opts if opt.startswith("--")}
    # A job runs on the cluster it was submitted to and prints JSON events: no --address, no --json.
    assert cli - {"--address", "--json", "--help"} <= job_options("train", capsys)

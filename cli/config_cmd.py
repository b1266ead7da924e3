"""`cs3 config show|explain`: see a resolved config and what every field means."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from .common import OverridesArg, console, overrides_list, user_errors

app = typer.Typer(help="Inspect job configs.", no_args_is_help=True)


@app.command("show")
@user_errors
def show(config: str = typer.Argument(..., help="YAML config file."),
         overrides: Optional[list[str]] = OverridesArg) -> None:
    """Print the resolved config (defaults, file and overrides merged) as YAML."""
    from cs3ray.config import load_config, to_yaml

    cfg = load_config(config, overrides_list(overrides))
    console.print(to_yaml(cfg), end="", highlight=False, markup=False)


@app.command("explain")
def explain_cmd() -> None:
    """List every config field with its default and meaning."""
    from cs3ray.config import explain

    table = Table("field", "default", "description", show_lines=False)
    for name, default, desc in explain():
        table.add_row(name, default, desc)
    console.print(table)

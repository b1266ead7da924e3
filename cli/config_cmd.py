"""`cs3 config show|explain`: see a resolved config and what every field means."""

from __future__ import annotations

import sys
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
    """List every config field with its default and meaning (tab-separated lines when not printed to a terminal)."""
    from cs3ray.config import explain

    rows = explain()
    if not sys.stdout.isatty():
        # Piped or redirected: a table would be cut to 80 columns and clip field names; one tab-separated
        # line per field keeps every name whole for grep and cut (FORCE_COLOR, which makes rich draw
        # tables into pipes, does not change that).
        for row in rows:
            typer.echo("\t".join(row))
        return
    table = Table("field", "default", "description", show_lines=False)
    for name, default, desc in rows:
        table.add_row(name, default, desc)
    console.print(table)

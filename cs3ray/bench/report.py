"""How every benchmark reports: a rich table for people, then one JSON line for machines."""

from __future__ import annotations

import json
from typing import Any, Iterable

from rich.console import Console
from rich.table import Table


def emit(title: str, columns: Iterable[str], rows: Iterable[Iterable[Any]], result: dict[str, Any],
         as_json: bool, console: Console | None = None) -> None:
    """Print the table (to stderr when --json, so stdout's last line is the JSON object)."""
    console = console or Console(stderr=as_json)
    table = Table(*columns, title=title)
    for row in rows:
        table.add_row(*[f"{v:,.3f}" if isinstance(v, float) else str(v) for v in row])
    console.print(table)
    if as_json:
        print(json.dumps(result), flush=True)

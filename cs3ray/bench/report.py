"""How every benchmark reports: a rich table for people, then one JSON line for machines.

Every benchmark's run goes through `measured`: a measurement that failed (an error raised by
the measured work, or a request, cell or run that recorded a `first_error`) becomes a
BenchError naming the first error, which the CLI prints as one line with exit code 1, instead
of a table of figures that measured nothing. Bad input stays a UserError: exit code 2.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Callable, Iterable

from rich.console import Console
from rich.table import Table

from cs3ray.errors import UserError

EXIT_CODES = "Exit codes: 0 measured; 1 the measured work failed (the first error is named); 2 bad input."


class BenchError(UserError):
    """A benchmark's measured work failed; exit code 1 (2 is for bad input)."""

    exit_code = 1


def first_failure(result: Any, path: str = "") -> str | None:
    """Where the first recorded failure in a result is and what it said, or None.

    A failure is any dict in the result (walked in order) whose `first_error` is set, such as
    a serve cell in which requests failed.
    """
    if isinstance(result, dict):
        if result.get("first_error"):
            count = f"{result['errors']} failed, " if isinstance(result.get("errors"), int) else ""
            return f"{path or 'result'}: {count}first error: {result['first_error']}"
        items: Iterable[tuple[str, Any]] = result.items()
    elif isinstance(result, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(result))
    else:
        return None
    for key, value in items:
        found = first_failure(value, f"{path}/{key}" if path else str(key))
        if found:
            return found
    return None


def measured(name: str, run: Callable[..., dict[str, Any]], *args: Any, **kwargs: Any) -> dict[str, Any]:
    """`run(*args, **kwargs)`'s result when all of its work was measured; else BenchError with the first error."""
    try:
        result = run(*args, **kwargs)
    except UserError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of the measured work ends the benchmark
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise BenchError(f"bench {name}: the measured work failed: {type(exc).__name__}"
                         + (f": {lines[0]}" if lines else "")) from exc
    failure = first_failure(result)
    if failure:
        raise BenchError(f"bench {name}: the measured work failed at {failure}")
    return result


_JSON_STREAMS: list[Any] = []


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
        # It stays stdout's last line: what Ray's log thread prints later (a raylet's warning) goes to stderr.
        # The stream is kept referenced, so a caller reading it afterwards (a test's runner) finds it open.
        _JSON_STREAMS.append(sys.stdout)
        sys.stdout = sys.stderr

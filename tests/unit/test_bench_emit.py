"""A bench's --json object stays stdout's last line, whatever the process prints after it."""

from __future__ import annotations

import json

from rich.console import Console

from cs3ray.bench.report import emit


def test_json_stays_the_last_line_of_stdout(capsys):
    emit("t", ["a"], [[1.5]], {"ratio": 1.5}, as_json=True, console=Console(stderr=True))
    print("(raylet) WARNING: 8 PYTHON worker processes have been started")  # as Ray's log thread does, later
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1]) == {"ratio": 1.5}
    assert "raylet" in err and "raylet" not in out

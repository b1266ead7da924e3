"""`cs3 bench` as a user runs it: JSON on the last line, and a bad argument is one line with exit 2."""

import json

from cs3ray.bench import disk

from conftest import run_cs3


def test_bench_disk_json_and_a_bad_path_is_one_line(tmp_path):
    bad = run_cs3(["bench", "disk", "--quick", "--path", str(tmp_path / "missing")])
    assert bad.returncode == 2 and "is not an existing folder" in bad.stderr and "Traceback" not in bad.stderr
    ok = run_cs3(["bench", "disk", "--quick", "--json", "--path", str(tmp_path)], check=True)
    assert set(json.loads(ok.stdout.strip().splitlines()[-1])) == set(disk.JSON_KEYS)

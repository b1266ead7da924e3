"""The suite's own layout: pytest's default import mode imports test modules by basename."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).resolve().parents[1]


def test_every_test_module_has_a_basename_of_its_own():
    # A clash stays hidden while one of the two skips at import (importorskip("vllm")) and breaks
    # collection of the whole suite once that dependency is installed.
    names = collections.Counter(p.name for p in TESTS.rglob("test_*.py"))
    assert [n for n, k in names.items() if k > 1] == []

"""Layers: the import-linter contracts hold, and the Ray job entry points use only cs3ray's public API."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from conftest import ROOT


def module_file(module: str) -> Path | None:
    """The source file of a cs3ray module or package, found without importing it."""
    base = ROOT.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.exists():
            return path
    return None


def public_names(path: Path) -> set[str]:
    """A module's `__all__` where it declares one, else the names it defines (not imports) without a `_`."""
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in node.targets):
            return set(ast.literal_eval(node.value))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    return {n for n in names if not n.startswith("_")}


def private_uses(source: str) -> list[str]:
    """What `source` imports from cs3ray that is not public: private or missing modules, and names
    outside a module's `__all__` (or, where it has none, starting with `_` or only imported there)."""
    found = []

    def check_module(module: str) -> bool:
        if any(part.startswith("_") for part in module.split(".")):
            found.append(f"{module} (a private module)")
        elif module_file(module) is None:
            found.append(f"{module} (no such module)")
        else:
            return True
        return False

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "cs3ray":
                    check_module(alias.name)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "cs3ray":
            if node.level or not check_module(node.module):
                continue
            public = public_names(module_file(node.module))
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                if module_file(submodule):
                    check_module(submodule)
                elif alias.name not in public:
                    found.append(f"{submodule} (not public)")
    return found


def test_jobs_import_only_public_cs3ray_functions():
    jobs = sorted((ROOT / "jobs").glob("*.py"))
    assert jobs
    for job in jobs:
        assert private_uses(job.read_text()) == [], job.name


def test_the_public_api_check_catches_private_imports():
    source = "\n".join([
        "import cs3ray.ckpt.chunks",
        "from cs3ray.train import train, TrainingError",  # both in cs3ray.train's __all__
        "from cs3ray.errors import UserError",            # a module without __all__: its public names
        "from cs3ray import storage",                     # a public module
        "from cs3ray.train import loop",                  # a submodule, public though not in __all__
        "from cs3ray.train.loop import _all_gather",      # a private function
        "from cs3ray.train import plan_batch",            # public in train.elastic, not in train's __all__
        "from cs3ray.serve.launch import UserError",      # imported there, defined in cs3ray.errors
        "from cs3ray.ckpt._hidden import x",              # a private module
        "import cs3ray.nothing_here",
    ])
    assert private_uses(source) == [
        "cs3ray.train.loop._all_gather (not public)", "cs3ray.train.plan_batch (not public)",
        "cs3ray.serve.launch.UserError (not public)", "cs3ray.ckpt._hidden (a private module)", "cs3ray.nothing_here (no such module)",
    ]


def test_the_layers_contract_holds():
    # The contracts in pyproject.toml, as `.ci/run` checks them (import-linter comes with the dev extra).
    run = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]

"""`cs3` starts without torch, Ray or torch.distributed.checkpoint: each command imports them when it runs."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

HEAVY = ("torch", "torch.distributed.checkpoint", "ray")


def heavy_modules_after(code: str) -> list[str]:
    """The modules of HEAVY a fresh interpreter has imported after running `code`."""
    check = f"\nimport sys\nprint('heavy:', *(m for m in {HEAVY!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code + check], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    heavy = [line for line in out.stdout.splitlines() if line.startswith("heavy:")]
    assert heavy, out.stdout[-500:]  # the check ran after the command
    return heavy[-1].split()[1:]


def test_importing_the_cli_imports_no_heavy_module():
    assert heavy_modules_after("import cs3ray_cli.main") == []


def test_help_imports_no_heavy_module():
    # --help builds every command's options, as any `cs3` invocation does before running one. The app
    # itself, not main(): main() ends the process once the command is done (cs3ray.ops.process_exit).
    code = ("import sys\nfrom cs3ray_cli.main import app\nsys.argv = ['cs3', '--help']\n"
            "try:\n    app()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code")
    assert heavy_modules_after(code) == []


def test_config_commands_run_without_torch(tmp_path):
    # Reading, checking and explaining a job config needs a model's shape, never a model.
    for args in (["config", "explain"], ["config", "show", "configs/tiny.yaml"]):
        code = ("import sys\nfrom cs3ray_cli.main import app\n"
                f"sys.argv = ['cs3', *{args!r}]\n"
                "try:\n    app()\nexcept SystemExit as exc:\n    assert not exc.code, exc.code")
        assert heavy_modules_after(code) == [], args


def test_the_cli_copies_of_library_names_agree():
    # Option help and defaults name them without importing their (torch-importing) modules.
    from cs3ray.config.runs import RUNS_DIR
    from cs3ray.ops.planner import SCENARIOS, SHAPES
    from cs3ray_cli import plan_cmd, report_cmd

    assert plan_cmd.SHAPE_NAMES == tuple(SHAPES)
    assert plan_cmd.SCENARIO_NAMES == tuple(SCENARIOS)
    assert report_cmd.RUNS_DIR == RUNS_DIR

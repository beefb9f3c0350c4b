"""The code base stays ruff-clean and keeps its import layers."""

import shutil
import subprocess
import sys
from pathlib import Path

from helpers.paths import ROOT


def test_ruff_is_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    result = subprocess.run([ruff, "check", "rft_hpc", "tests", "tools"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_imports_keep_the_layers_and_have_no_cycles():
    """pyproject.toml's import contracts ([tool.importlinter]): each package imports only
    from the layers below it, and no modules or packages import each other in a cycle."""
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    result = subprocess.run([lint, "--no-cache"], cwd=ROOT, capture_output=True, text=True)
    print(result.stdout[-2000:])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Contracts: 2 kept, 0 broken." in result.stdout


def test_no_module_is_left_at_the_top_of_the_package():
    """Every module lives in a subpackage that says what it holds (its __init__'s first line)."""
    package = ROOT / "rft_hpc"
    assert sorted(p.name for p in package.glob("*.py")) == ["__init__.py"]
    for init in sorted(package.glob("*/__init__.py")):
        doc = init.read_text().split('"""')
        assert len(doc) >= 3 and doc[1].strip(), f"{init} has no docstring"
        assert "\n" not in doc[1].strip(), f"{init}: its docstring is more than one line"

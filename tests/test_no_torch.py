"""planner/ and api/ must never import torch: the service starts fast on machines without it."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _modules(package: str) -> list[str]:
    """The package and every module under it, subpackages included (``__main__`` left out)."""
    path = ROOT / package
    return [package] + [
        m.name for m in pkgutil.walk_packages([str(path)], prefix=f"{package}.") if not m.name.endswith(".__main__")
    ]


@pytest.mark.parametrize("package", ["planner", "api", "pipeplan"])
def test_package_does_not_import_torch(package: str) -> None:
    mods = _modules(package)
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.'))\n"
        "print(len(bad))\n"
        "sys.exit(1 if bad else 0)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"importing {package} pulled in torch:\n{proc.stdout}{proc.stderr}"


def test_check_detects_torch() -> None:
    """The probe above can fail: importing a torch-using module is seen."""
    code = "import sys, profiler.measure; sys.exit(1 if 'torch' in sys.modules else 0)"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    if "No module named 'profiler.measure'" in proc.stderr:
        pytest.skip("profiler.measure not present")
    assert proc.returncode == 1

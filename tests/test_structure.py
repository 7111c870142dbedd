"""The package's shape: every jax_ep module imports on its own, first, in a fresh interpreter (an import cycle
fails there, whatever order other imports would hide it behind), and the process environment is touched by one
module only (jax_ep.environment), so no compiled program depends on a variable read while tracing."""
from __future__ import annotations

import os
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jax_ep

PACKAGE = Path(jax_ep.__file__).resolve().parent
MODULES = sorted(m.name for m in pkgutil.walk_packages([str(PACKAGE)], prefix="jax_ep.")
                 if not m.name.endswith("__main__"))


@pytest.mark.parametrize("module", MODULES)
def test_module_imports_first(module):
    run = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"))
    if run.returncode and ("No module named 'flax'" in run.stderr or "No module named 'tqdm'" in run.stderr):
        pytest.skip(f"{module} needs an optional dependency")
    assert run.returncode == 0, run.stderr[-3000:]


def test_environment_is_read_in_one_module():
    readers = sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                     if re.search(r"\bos\.(environ|getenv|putenv)\b", p.read_text()))
    assert readers == ["environment.py"], readers

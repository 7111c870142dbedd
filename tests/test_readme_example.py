"""README.md's examples (the ops, the Flax block) run as written (in a fresh interpreter, on the CPU) and print
their results."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def test_readme_example_runs_as_written(tmp_path):
    example = re.search(r"## Example\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the example sets its own device count
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         env=dict(env, JAX_PLATFORMS="cpu"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    match = re.search(r"(\d+) ranks, backend xla: out \(\d+, \d+\), max error (\S+), grad max error (\S+)", run.stdout)
    assert match, run.stdout
    assert int(match.group(1)) == 8 and float(match.group(2)) < 1e-4 and float(match.group(3)) < 1e-4, run.stdout


def test_readme_flax_example_runs_as_written(tmp_path):
    pytest.importorskip("flax")
    example = re.search(r"## Flax MoE block\n.*?```python\n(.*?)```", README.read_text(), re.S).group(1)
    script = tmp_path / "flax_example.py"
    script.write_text(example)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env=dict(env, JAX_PLATFORMS="cpu"), cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    match = re.search(r"(\d+) ranks, loss (\S+), router grad norm (\S+)", run.stdout)
    assert match, run.stdout
    assert int(match.group(1)) == 8 and 0 < float(match.group(2)) < 10 and float(match.group(3)) > 0, run.stdout

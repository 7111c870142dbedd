"""The package's shape: every jax_ep module imports on its own, first, in a fresh interpreter; no jax_ep module
imports another that imports it back, directly or through others, at the top or inside a function (a cycle that
an import order or a deferred import would hide); and the process environment is touched by one module only
(jax_ep.environment), so no compiled program depends on a variable read while tracing. In tests/: no test
module imports another (shared helpers are modules of their own), and only conftest swaps a Buffer's backend."""
from __future__ import annotations

import ast
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


def module_name(path: Path) -> str:
    """The dotted name of the jax_ep module in `path` (a package by its __init__.py)."""
    parts = ("jax_ep",) + path.relative_to(PACKAGE).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(path: Path, modules: set[str]) -> set[str]:
    """The modules of `modules` that the source in `path` imports anywhere (inside functions and conditions too):
    `import a.b` names a.b; `from a import b` names a.b when that is a module, else a; relative imports resolved."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found |= {f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names}
    return found & modules


def import_graph() -> dict[str, set[str]]:
    """Each jax_ep module's source -> the jax_ep modules it imports. The nodes include the compiled extension
    (jax_ep._C), which can lie in another directory of the package's __path__ (an editable install) and imports none."""
    sources = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(sources)
    for init in PACKAGE.rglob("__init__.py"):
        directories = [str(Path(d) / init.parent.relative_to(PACKAGE)) for d in jax_ep.__path__]
        modules |= {f"{module_name(init)}.{m.name}" for m in pkgutil.iter_modules(directories)}
    return {name: imported_modules(path, modules) - {name} for name, path in sources.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` as the list of its modules, first one repeated at the end; None when it is acyclic."""
    state: dict[str, str] = {}  # "open" while on the current path, "done" once every path from it was followed
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        path.append(node)
        for child in sorted(graph.get(node, ())):
            if state.get(child) == "open":
                return path[path.index(child):] + [child]
            if child not in state and (cycle := visit(child)):
                return cycle
        path.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_cycle_finder():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_no_import_cycle():
    graph = import_graph()
    # The graph sees the package's real imports: these edges exist (at module level or inside functions).
    assert {"jax_ep.buffer", "jax_ep.backends"} <= graph["jax_ep.ops"], graph["jax_ep.ops"]
    assert "jax_ep._grouped_matmul_kernels" in graph["jax_ep.grouped_matmul"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


TESTS = Path(__file__).resolve().parent


def python_sources() -> list[Path]:
    """Every Python file under tests/."""
    return sorted(p for p in TESTS.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_test_module_imports_a_test_module():
    local = {p.stem for p in TESTS.glob("*.py")} | {p.name for p in TESTS.iterdir() if p.is_dir()}
    importers = []
    for path in python_sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
                relative = False
            elif isinstance(node, ast.ImportFrom):  # `from a.test_b import c`, `from a import test_b`
                names = [node.module or ""] + [f"{node.module or ''}.{alias.name}" for alias in node.names]
                relative = node.level > 0
            else:
                continue
            importers += [f"{path.relative_to(TESTS)}: {name}" for name in names
                          if (relative or name.split(".")[0] in local) and name.rpartition(".")[2].startswith("test_")]
    assert importers == [], importers


def test_only_conftest_swaps_a_buffers_backend():
    assigners = sorted(str(p.relative_to(TESTS)) for p in python_sources()
                       if re.search(r"\.backend_impl\s*=[^=]", p.read_text()))
    assert assigners == ["conftest.py"], assigners

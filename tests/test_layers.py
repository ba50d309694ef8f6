"""The package's import map: no circle, and each floor imports only the floors below it.

Every ``import`` and ``from ... import`` of every module of ``kvconductor`` counts,
wherever it stands (module top, inside a function, under ``TYPE_CHECKING``): a lazy
import is still a dependency. The floors, lowest first (CONTRIBUTING.md, "Layout"):

* the lower floors: the compiled modules and their twins (``_py``), ``index``, ``wire``,
  ``schema``, ``keys``, ``urls``, ``errors``, ``logs``, the package itself;
* ``ingest/``: sockets, sequence tracking, decoders, apply;
* ``state/``: the conductor (the single writer), registrations, the shared index,
  dumps, snapshots, replication;
* ``http/``: the Falcon resources, limits, OpenAPI, metrics;
* ``tools/``: ``kv-conductor top`` and ``explain``;
* ``serve/``: settings, the command line, the processes.

``coordinator/`` stands apart: it imports only itself and ``schema`` (a Coordinator
installs the client without the server), and loads no compiled module. The old paths
kept for users (``kvconductor.app``, ``cli``, ``client``, ``affinity``, ``__main__``)
sit on top; nothing inside the package imports them.
"""

from __future__ import annotations

import ast
import pathlib
import re
import subprocess
import sys

import pytest

import kvconductor

PKG = pathlib.Path(kvconductor.__file__).parent

LOWER, INGEST, STATE, HTTP, TOOLS, SERVE = range(6)
FLOORS = {"ingest": INGEST, "state": STATE, "http": HTTP, "tools": TOOLS, "serve": SERVE}
FLOOR_NAMES = ["lower floors", "ingest/", "state/", "http/", "tools/", "serve/"]
#: The old paths kept for users: on top of everything, imported by nothing inside.
COMPAT = {
    "kvconductor.app",
    "kvconductor.cli",
    "kvconductor.client",
    "kvconductor.affinity",
    "kvconductor.__main__",
}
COORDINATOR_MAY_IMPORT = {"kvconductor.schema"}


def _module_name(path: pathlib.Path) -> str:
    parts = ("kvconductor", *path.relative_to(PKG).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(PKG.rglob("*.py"))}


MODULES = _modules()


def _resolve(name: str) -> str:
    """The module an imported dotted name lands in (``a.b.func`` -> ``a.b``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _submodule_or(base: str, name: str) -> str:
    """``from base import name``: the module ``base.name`` if there is one, else ``base``."""
    return f"{base}.{name}" if f"{base}.{name}" in MODULES else base


def imports_of(module: str) -> set[str]:
    """Every ``kvconductor`` module ``module`` imports, anywhere in its source."""
    path = MODULES[module]
    is_pkg = path.name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base_parts = module.split(".")
                if not is_pkg:
                    base_parts = base_parts[:-1]
                base_parts = base_parts[: len(base_parts) - (node.level - 1)]
                base = ".".join(base_parts + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from pkg import mod` imports the module pkg.mod; `from mod import name` mod.
            names = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names
            ]
        for name in names:
            if name == "kvconductor" or name.startswith("kvconductor."):
                target = _resolve(name)
                if target != module:
                    out.add(target)
    return out


GRAPH = {m: imports_of(m) for m in MODULES}


def floor(module: str) -> int | None:
    """The floor of ``module``; ``None`` for ``coordinator/`` and the old paths."""
    if module in COMPAT or module.startswith("kvconductor.coordinator"):
        return None
    parts = module.split(".")
    return FLOORS.get(parts[1], LOWER) if len(parts) > 1 else LOWER


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as ``[a, b, ..., a]``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n) :] + [n]
            if n not in state:
                found = visit(n)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def test_the_walk_sees_the_package():
    # The walk would pass vacuously on an empty map: check it sees real edges.
    assert len(MODULES) > 40
    assert "kvconductor.state.conductor" in GRAPH["kvconductor.http.api"]
    assert "kvconductor.schema" in GRAPH["kvconductor.coordinator.core"]
    # A lazy import (inside a function) counts.
    assert "kvconductor.serve.owner" in GRAPH["kvconductor.serve.cli"]


def test_find_cycle_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_no_import_circle():
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or ())


def test_each_floor_imports_only_the_floors_below():
    wrong = []
    for m, targets in GRAPH.items():
        f = floor(m)
        if f is None:
            continue
        for t in targets:
            ft = floor(t)
            if ft is None or ft > f:
                wrong.append(f"{m} ({FLOOR_NAMES[f]}) imports {t}")
    assert not wrong, "\n".join(sorted(wrong))


@pytest.mark.parametrize(
    "floor_name,forbidden",
    [("http", {"serve"}), ("state", {"http", "serve"}), ("ingest", {"state", "http", "serve"})],
)
def test_the_named_rules(floor_name, forbidden):
    # The rules as the layout states them (the floor test above implies them).
    wrong = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if m.startswith(f"kvconductor.{floor_name}.")
        for t in targets
        if t.split(".")[1:2] and t.split(".")[1] in forbidden
    ]
    assert not wrong, "\n".join(wrong)


def test_nothing_imports_the_old_paths():
    wrong = [f"{m} imports {t}" for m, ts in GRAPH.items() for t in ts if t in COMPAT]
    assert not wrong, "\n".join(wrong)


def test_coordinator_imports_nothing_of_the_server():
    wrong = [
        f"{m} imports {t}"
        for m, targets in GRAPH.items()
        if m.startswith("kvconductor.coordinator")
        for t in targets
        if not t.startswith("kvconductor.coordinator")
        and t not in COORDINATOR_MAY_IMPORT
        and t != "kvconductor"
    ]
    assert not wrong, "\n".join(wrong)


def test_compiled_modules_import_only_the_lower_floors():
    # A .pyx/.pxd/.pxi names other modules with `cimport` and `import` lines.
    from_line = re.compile(r"^\s*from\s+(kvconductor(?:\.\w+)*)\s+c?import\s+([\w, ]+)", re.M)
    plain = re.compile(r"^\s*c?import\s+(kvconductor(?:\.\w+)*)", re.M)
    wrong = []
    sources = sorted([*PKG.glob("*.pyx"), *PKG.glob("*.pxd"), *PKG.glob("*.pxi")])
    assert len(sources) > 20
    seen = 0
    for path in sources:
        text = path.read_text()
        names = [
            f"{base}.{name.strip()}" if base == "kvconductor" else base
            for base, listed in from_line.findall(text)
            for name in listed.split(",")
            if name.strip()
        ] + plain.findall(text)
        seen += len(names)
        for name in names:
            if name == "kvconductor" or floor(name) != LOWER:
                wrong.append(f"{path.name} imports {name}")
    assert seen > 20  # the patterns do see the cimports
    assert not wrong, "\n".join(wrong)


def _loaded_after(statement: str) -> list[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    return out.stdout.split()


@pytest.mark.parametrize(
    "statement",
    ["import kvconductor.coordinator", "import kvconductor.client", "import kvconductor.affinity"],
)
def test_coordinator_loads_no_compiled_module(statement):
    loaded = _loaded_after(statement)
    compiled = {f"kvconductor.{name}" for name in kvconductor.COMPILED_MODULES}
    assert "kvconductor.coordinator" in loaded
    assert not compiled & set(loaded), sorted(compiled & set(loaded))
    # Nor the server's stack.
    assert not {"falcon", "uvicorn", "zmq"} & set(loaded)


def test_the_index_loads_every_compiled_module():
    # The service side: the first import of the index loads them all (a broken install
    # fails there, not at the first query).
    loaded = set(_loaded_after("import kvconductor.index"))
    assert {f"kvconductor.{name}" for name in kvconductor.COMPILED_MODULES} <= loaded


# -- the tests themselves: helpers shared through tests/helpers and conftest.py ------------

TESTS = pathlib.Path(__file__).resolve().parent
_SYS_PATH_MUTATORS = {"insert", "append", "extend", "__setitem__", "__iadd__"}


def _is_sys_path(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "path"
        and isinstance(node.value, ast.Name)
        and node.value.id == "sys"
    )


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") or part == "conftest" for part in name.split("."))


def _hygiene_faults(source: str) -> list[str]:
    """Lines of ``source`` that change ``sys.path`` or import a test module (``test_*``,
    wherever it sits in the dotted name, or a ``conftest``)."""
    faults = []
    for node in ast.walk(ast.parse(source)):
        where = getattr(node, "lineno", 0)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if node.func.attr in _SYS_PATH_MUTATORS and _is_sys_path(node.func.value):
                faults.append(f"{where}: sys.path.{node.func.attr}")
        elif isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if _is_sys_path(t) or (isinstance(t, ast.Subscript) and _is_sys_path(t.value)):
                    faults.append(f"{where}: assignment to sys.path")
        elif isinstance(node, ast.Import):
            faults += [f"{where}: import {a.name}" for a in node.names if _is_test_module(a.name)]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if module == "sys" and any(a.name == "path" for a in node.names):
                faults.append(f"{where}: from sys import path")
            elif _is_test_module(module):
                faults.append(f"{where}: from {'.' * node.level}{module} import")
            else:
                faults += [
                    f"{where}: from {'.' * node.level}{module} import {a.name}"
                    for a in node.names
                    if _is_test_module(a.name)
                ]
    return faults


def test_the_hygiene_check_sees_the_forbidden_forms():
    bad = """
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
sys.path.append("x")
sys.path[:0] = ["x"]
sys.path += ["x"]
from sys import path
import test_api
import tests.test_server as ts
from test_server import Server
from tests.test_cluster import gone
from tests import test_security
from .test_replica import start_replicas
from . import conftest
from conftest import core_class
"""
    assert len(_hygiene_faults(bad)) == 13, _hygiene_faults(bad)
    good = """
import sys
from tests.helpers.server import Server
from tests.helpers import publishers
print(sys.path)
"""
    assert _hygiene_faults(good) == []


def test_tests_share_helpers_without_sys_path_or_test_imports():
    """Shared test code lives in ``tests/helpers/`` (and fixtures in ``conftest.py``):
    no file under ``tests/`` changes ``sys.path`` or imports a test module."""
    files = sorted(TESTS.rglob("*.py"))
    assert len(files) > 50 and TESTS / "helpers" / "server.py" in files
    faults = [
        f"{path.relative_to(TESTS.parent)}:{fault}"
        for path in files
        for fault in _hygiene_faults(path.read_text())
    ]
    assert not faults, "\n".join(faults)

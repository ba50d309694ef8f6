"""Fails when the compiled modules did not load (CI must run the C code)."""

import ast
import importlib
import importlib.machinery
import os
import subprocess
import sys

import kvconductor


def test_compiled_modules_loaded():
    assert kvconductor.is_available(), kvconductor.unavailable_reason()
    for name in kvconductor.COMPILED_MODULES:
        mod = importlib.import_module(f"kvconductor.{name}")
        assert mod.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES)), mod.__file__


def test_compiled_modules_match_setup_py():
    text = open(os.path.join(os.path.dirname(__file__), os.pardir, "setup.py")).read()
    (modules,) = [
        ast.literal_eval(node.value)
        for node in ast.parse(text).body
        if isinstance(node, ast.Assign)
        and [getattr(t, "id", None) for t in node.targets] == ["MODULES"]
    ]
    assert modules == list(kvconductor.COMPILED_MODULES)


def test_index_uses_compiled_core_by_default():
    from kvconductor._index import CoreIndex as CCore
    from kvconductor.index import Index

    if kvconductor.IMPL == "c":
        assert type(Index("m", "t").core) is CCore
    assert type(Index("m", "t", impl="c").core) is CCore


def _run(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_impl_env_selects_the_twins_everywhere():
    code = (
        "import kvconductor, kvconductor.wire as w, kvconductor.ingest.apply as a, "
        "kvconductor.ingest.vllm as v; from kvconductor.index import Index; "
        "print(kvconductor.IMPL, w.IMPL, a._FastBatch is None, v._read_u32_array is None, "
        "type(Index('m', 't').core).__module__)"
    )
    out = _run(code, KVCONDUCTOR_IMPL="py")
    assert out.stdout.split() == ["py", "py", "True", "True", "kvconductor._py.index"], out.stderr
    out = _run(code, KVCONDUCTOR_IMPL="c")
    assert out.stdout.split() == ["c", "c", "False", "False", "kvconductor._index"], out.stderr


def test_bad_impl_env_fails_at_import():
    out = _run("import kvconductor", KVCONDUCTOR_IMPL="rust")
    assert out.returncode != 0 and "KVCONDUCTOR_IMPL" in out.stderr

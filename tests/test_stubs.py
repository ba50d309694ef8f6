"""The .pyi stubs name exactly the public callables and constants of the compiled modules."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from kvconductor import COMPILED_MODULES

PKG = Path(__file__).resolve().parent.parent / "kvconductor"
MODULES = list(COMPILED_MODULES)


def stub_names(name: str) -> set[str]:
    """The public names a stub declares (a private one, like ``_tree._Chains`` the base of
    two modules' wrappers or a stub-only Protocol, is no API of its own)."""
    tree = ast.parse((PKG / f"{name}.pyi").read_text())
    out = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if not n.startswith("_")}


@pytest.mark.parametrize("name", MODULES)
def test_stub_matches_module(name):
    mod = importlib.import_module(f"kvconductor.{name}")
    public = {
        n
        for n, v in vars(mod).items()
        if not n.startswith("_")
        and getattr(v, "__module__", mod.__name__) == mod.__name__
        and (callable(v) or isinstance(v, (int, str, tuple)))
    }
    assert stub_names(name) == public

"""Shared fixtures: every semantic test runs on the pure-Python twins ("py") and
on the compiled core ("c"; skipped while ``kvconductor._index`` is not built)."""

from __future__ import annotations

import importlib

import pytest

IMPLS = ("py", "c")

_MODULES = {
    "py": {
        "tree": "kvconductor._py.tree",
        "lower": "kvconductor._py.lower",
        "index": "kvconductor._py.index",
    },
    "c": {
        "tree": "kvconductor._tree",
        "lower": "kvconductor._lower",
        "index": "kvconductor._index",
    },
}
_CLASSES = {"tree": "RadixTree", "lower": "LowerTier", "index": "CoreIndex"}


def core_class(impl: str, kind: str):
    """The class ``kind`` ("tree", "lower" or "index") of implementation ``impl``."""
    module = importlib.import_module(_MODULES[impl][kind])
    return getattr(module, _CLASSES[kind])


def require_impl(impl: str) -> None:
    """Skip the current test when ``impl`` is not importable."""
    if impl == "c":
        pytest.importorskip("kvconductor._index")
        pytest.importorskip("kvconductor._tree")
        pytest.importorskip("kvconductor._lower")


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    """ "py" or "c"; the compiled variant is skipped until the modules exist."""
    require_impl(request.param)
    return request.param


@pytest.fixture
def RadixTree(impl):
    return core_class(impl, "tree")


@pytest.fixture
def LowerTier(impl):
    return core_class(impl, "lower")


@pytest.fixture
def CoreIndex(impl):
    return core_class(impl, "index")

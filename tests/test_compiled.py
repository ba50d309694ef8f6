"""Fails when the compiled index modules did not load (CI must run the C core)."""
import os

import pytest

import kvconductor


@pytest.mark.skipif(bool(os.environ.get("KVCONDUCTOR_NO_EXTENSIONS")),
                    reason="extensions disabled on purpose")
def test_compiled_modules_loaded():
    assert kvconductor.is_available(), kvconductor.unavailable_reason()


def test_index_uses_compiled_core_by_default(monkeypatch):
    monkeypatch.delenv("KVCONDUCTOR_IMPL", raising=False)
    from kvconductor._index import CoreIndex as CCore
    from kvconductor.index import Index
    assert type(Index("m", "t").core) is CCore

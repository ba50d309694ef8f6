"""``kv-conductor``'s command line, kept at its old path; the code lives in
:mod:`kvconductor.serve.cli`. ``main`` resolves without a warning (entry points written
against ``kvconductor.cli:main`` keep working); other names warn and resolve."""

from __future__ import annotations

import importlib
import warnings


def main(argv: list[str] | None = None) -> int:
    """``kv-conductor`` (:func:`kvconductor.serve.cli.main`)."""
    from kvconductor.serve.cli import main as _main

    return _main(argv)


def __getattr__(name: str) -> object:
    cli = importlib.import_module("kvconductor.serve.cli")
    if not hasattr(cli, name):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    warnings.warn(
        f"kvconductor.cli.{name} moved to kvconductor.serve.cli.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(cli, name)

"""Repository-level pytest switches.

``pytest`` runs the test suite in ``tests/``; ``pytest --benchmark`` runs the
benchmark suite in ``bench/`` instead, with pytest-benchmark's timing on (the
project's default ``addopts`` disable it so tests never time anything).
"""
from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true", default=False,
                     help="run the benchmark suite in bench/ with timing on "
                          "(same as: pytest bench --benchmark-enable --benchmark-only)")


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if config.getoption("--benchmark"):
        config.option.benchmark_enable = True
        config.option.benchmark_only = True


def pytest_ignore_collect(collection_path, config):
    if collection_path.parent != ROOT or not collection_path.is_dir():
        return None
    bench = config.getoption("--benchmark")
    if collection_path.name == "bench" and not bench:
        return True
    if collection_path.name == "tests" and bench:
        return True
    return None

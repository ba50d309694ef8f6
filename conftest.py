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
    parser.addoption(
        "--benchmark",
        action="store_true",
        default=False,
        help="run the benchmark suite in bench/ with timing on "
        "(same as: pytest bench --benchmark-enable --benchmark-only)",
    )


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    if not config.getoption("--benchmark"):
        return
    config.option.benchmark_enable = True
    config.option.benchmark_only = True
    # With no paths on the command line, collect bench/ instead of the testpaths.
    if config.args_source == pytest.Config.ArgsSource.TESTPATHS:
        config.args[:] = [str(ROOT / "bench")]

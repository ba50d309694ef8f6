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


@pytest.fixture(scope="session", autouse=True)
def _state_home_stays_empty(tmp_path_factory):
    """A server started by a test never writes outside the test's own directories: the
    session points ``XDG_STATE_HOME`` (under which a server keeps its default snapshot
    directory) at an empty temporary directory, and it must still be empty at the end.
    Each server passes ``--snapshot-dir`` into its test's directory or
    ``--no-snapshots``."""
    state = tmp_path_factory.mktemp("xdg-state")
    patch = pytest.MonkeyPatch()
    patch.setenv("XDG_STATE_HOME", str(state))
    yield state
    patch.undo()
    left = sorted(str(p.relative_to(state)) for p in state.rglob("*"))
    assert not left, f"servers started by the tests wrote into the default state directory: {left}"

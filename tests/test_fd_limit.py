"""The open-file limit: raised once at start (service.raise_fd_limit), the HTTP
connection cap fitted to it (server.fit_connection_cap); docs/operations.md,
"Open files", and docs/security.md."""

from __future__ import annotations

import logging
import resource

import pytest

from kvconductor.http.limits import HttpLimits
from kvconductor.serve.single import fit_connection_cap
from kvconductor.serve.tuning import fds_needed, raise_fd_limit

INF = resource.RLIM_INFINITY


@pytest.fixture
def rlimit(monkeypatch):
    """A fake RLIMIT_NOFILE: ``state["limit"]`` is (soft, hard); ``state["refuse"]`` values fail."""
    state = {"limit": (1024, 4096), "refuse": set(), "calls": []}

    def setrlimit(which, value):
        assert which == resource.RLIMIT_NOFILE
        state["calls"].append(value)
        if value[0] in state["refuse"]:
            raise ValueError("not allowed")
        state["limit"] = value

    monkeypatch.setattr(resource, "getrlimit", lambda which: state["limit"])
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    return state


def test_need_is_four_files_per_source_plus_connections_plus_headroom():
    assert fds_needed(4096, 1024) == 17664  # the figure in docs/operations.md


def test_soft_limit_goes_to_the_hard_limit_like_go(rlimit, caplog):
    rlimit["limit"] = (1024, 100_000)
    with caplog.at_level(logging.INFO, logger="kvconductor"):
        assert raise_fd_limit(4096, 1000) == 100_000
    assert rlimit["limit"] == (100_000, 100_000)
    assert "raised the open-file limit from 1024 to 100000" in caplog.text
    assert "below" not in caplog.text


def test_unlimited_hard_limit_raises_to_what_is_needed(rlimit):
    rlimit["limit"] = (1024, INF)
    assert raise_fd_limit(10, 1000) == fds_needed(10, 1000) == 1296
    assert rlimit["limit"] == (1296, INF)


def test_hard_limit_below_the_need_warns_with_the_documented_message(rlimit, caplog):
    rlimit["limit"] = (256, 1024)
    with caplog.at_level(logging.WARNING, logger="kvconductor"):
        assert raise_fd_limit(4096, 1024) == 1024
    assert (
        "open-file limit 1024 is below the 17664 that --max-sources needs; "
        "registrations past the limit will be refused with 503"
    ) in caplog.text


def test_a_refused_value_falls_back_to_what_is_needed(rlimit, caplog):
    rlimit["limit"], rlimit["refuse"] = (1024, 100_000), {100_000}
    assert raise_fd_limit(10, 1000) == 1296
    assert rlimit["calls"] == [(100_000, 100_000), (1296, 100_000)]
    assert "could not raise" not in caplog.text


def test_nothing_allowed_warns_once(rlimit, caplog):
    rlimit["limit"], rlimit["refuse"] = (1024, INF), {17640, 1256}
    with caplog.at_level(logging.WARNING, logger="kvconductor"):
        assert raise_fd_limit(4096, 1000) == 1024
    assert "could not raise the open-file limit from 1024 to 17640: not allowed" in caplog.text
    assert "open-file limit 1024 is below the 17640" in caplog.text


def test_unlimited_soft_limit_is_left_alone(rlimit):
    rlimit["limit"] = (INF, INF)
    assert raise_fd_limit(4096, 1000) is None and rlimit["calls"] == []


def test_connection_cap_is_kept_when_it_fits(rlimit):
    rlimit["limit"] = (2000, 2000)
    assert fit_connection_cap(HttpLimits(max_connections=1000)) == (
        HttpLimits(max_connections=1000),
        2000,
    )
    rlimit["limit"] = (INF, INF)
    assert fit_connection_cap(HttpLimits(max_connections=1000)) == (
        HttpLimits(max_connections=1000),
        None,
    )


def test_connection_cap_is_lowered_to_fit_the_limit(rlimit, caplog):
    rlimit["limit"] = (1024, 1024)
    with caplog.at_level(logging.WARNING, logger="kvconductor"):
        limits, fd_limit = fit_connection_cap(HttpLimits(max_connections=1000))
    assert (limits.max_connections, fd_limit) == (768, 1024) and rlimit["calls"] == []
    assert "--max-connections lowered from 1000 to 768" in caplog.text  # docs/security.md

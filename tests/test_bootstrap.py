"""kvconductor.serve.bootstrap: the one composition root, role by role.

The processes themselves run in tests/test_server.py (single), tests/test_cluster.py
(owner and workers) and the gunicorn tests; here the service each role gets, built in
this process without serving it (the process tuning recorded, not applied).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import threading

import falcon.asgi
import pytest

from kvconductor._shlock import SLOTS
from kvconductor.http.front import FrontDoor
from kvconductor.serve import bootstrap
from kvconductor.serve.bootstrap import StartFailed, build_service
from kvconductor.serve.proxy import Forwarder
from kvconductor.serve.settings import Settings
from kvconductor.state.conductor import Conductor


@pytest.fixture
def tuned(monkeypatch):
    """The tuning calls of build_service, recorded instead of applied."""
    calls: list[tuple] = []
    monkeypatch.setattr(bootstrap.sys, "setswitchinterval", lambda v: calls.append(("gil", v)))
    monkeypatch.setattr(bootstrap, "raise_fd_limit", lambda *a: calls.append(("fd", *a)))
    monkeypatch.setattr(bootstrap, "tune_malloc", lambda: calls.append(("malloc",)))
    return calls


@pytest.mark.parametrize(
    "role,fd,malloc",
    [
        ("single", (4096, 1000), True),
        ("gunicorn", (4096, 1000), True),
        ("owner", (4096, 3000), False),  # the connections of every worker
        ("worker", (1, 1000), True),
    ],
)
def test_tune_process_per_role(tuned, role, fd, malloc):
    bootstrap.tune_process(Settings(workers=3, max_sources=4096, max_connections=1000), role)
    expected = [("gil", bootstrap.SWITCH_INTERVAL), ("fd", *fd)] + ([("malloc",)] if malloc else [])
    assert tuned == expected


@pytest.mark.parametrize("role", ["single", "gunicorn"])
def test_one_process_gets_the_conductor_behind_the_front_door(tuned, role):
    service = build_service(Settings(), role)
    assert tuned[0] == ("gil", bootstrap.SWITCH_INTERVAL)
    assert isinstance(service.conductor, Conductor) and not service.conductor.thread.is_alive()
    app = service.app
    assert isinstance(app, FrontDoor) and isinstance(app.rest, falcon.asgi.App)
    assert sorted(app.routes) == ["/query", "/query_by_hash"] and not app.health
    assert service.supervisor is None and service.forwarder is None
    # start and stop: the conductor runs in between (no dump, no snapshots, no replica)
    # the ingest thread gives the event loop the CPU first (kvconductor.serve.tuning)
    assert service.conductor.thread.nice == bootstrap.INGEST_NICE == 5
    assert service.start() is True
    try:
        assert service.conductor.thread.is_alive()
        if sys.platform.startswith("linux"):
            main = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            ingest = service.conductor.thread.call(
                lambda: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            )
            assert ingest == min(19, main + 5)
    finally:
        service.stop()
    assert not service.conductor.thread.is_alive()


def test_the_owner_of_shared_workers_keeps_its_ingest_threads_priority(monkeypatch):
    """``--workers N``: the owner's ingest thread holds the write sections the workers'
    readers wait for; it is not lowered."""
    handed: dict[str, object] = {}

    def conductor(config, **kwargs):
        handed.update(kwargs)
        return None

    monkeypatch.setattr(bootstrap, "Conductor", conductor)
    bootstrap.new_conductor(Settings(workers=2), shared=object())
    assert handed["thread"].nice == 0
    bootstrap.new_conductor(Settings())
    assert handed["thread"].nice == bootstrap.INGEST_NICE


def test_owner_refuses_more_workers_than_reader_slots(tuned, capsys):
    supervised = []
    with pytest.raises(StartFailed, match="reader slots"):
        build_service(Settings(workers=SLOTS), "owner", supervise=supervised.append)
    assert supervised == []  # no port bound, no private directory made
    assert "kv-conductor: error: --workers" in capsys.readouterr().err


def test_worker_without_a_shared_index_forwards_every_request(tuned, tmp_path):
    service = build_service(
        Settings(max_body_mb=1), "worker", owner_socket=str(tmp_path / "missing.sock")
    )
    assert ("fd", 1, 1000) in tuned and service.conductor is None
    app = service.app
    assert isinstance(app, FrontDoor) and app.health and app.routes == {}
    assert isinstance(app.rest, Forwarder) and service.forwarder is app.rest
    assert app.rest.query_metrics is service.query_metrics
    assert service.start() is True  # nothing to start in a worker

    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {
        "type": "http",
        "method": "POST",
        "path": "/query",
        "raw_path": b"/query",
        "query_string": b"",
        "headers": [(b"content-length", b"2")],
        "client": ("127.0.0.1", 1),
    }
    asyncio.run(app(scope, receive, send))
    service.stop()
    assert sent[0]["status"] == 503  # forwarded: the owner is not there
    assert json.loads(sent[1]["body"])["error"].startswith("the index owner process")

"""kvconductor.state.journal: every HTTP mutation goes through the conductor's journal;
the local and the replicated journal apply through one table of mutation kinds."""

from __future__ import annotations

import asyncio
import types

import falcon.testing as ft
import msgspec
import pytest

from kvconductor.http.api import create_app
from kvconductor.schema import register_decoder, unregister_decoder
from kvconductor.state import journal as journal_module
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.journal import (
    MUTATIONS,
    LocalJournal,
    Mutation,
    UnknownMutation,
    apply_logged,
)
from kvconductor.state.protocols import NoSubscriptions

REG = {
    "instance_id": "i1",
    "type": "vLLM",
    "modelname": "m",
    "block_size": 4,
    "dp_rank": 0,
    "medium_endpoints": None,
    "endpoint": None,
}
UNREG = {"instance_id": "i1", "type": "vLLM", "modelname": "m", "block_size": 4, "dp_rank": 0}


@pytest.fixture
def conductor():
    c = Conductor(ConductorConfig(maintenance_interval=3600), subscriptions=NoSubscriptions)
    c.start()
    yield c
    assert c.stop(5.0)


def _submit(j, kind: str, body: bytes, args: tuple) -> object:
    return asyncio.run(j.submit(kind, body, args))


def test_the_table_names_the_http_mutations():
    assert sorted(MUTATIONS) == ["events", "predict", "register", "unregister"]


def test_local_journal_applies_at_once_and_returns_the_result(conductor):
    j = LocalJournal(conductor, conductor.thread)
    body = msgspec.json.encode(REG)
    assert _submit(j, "register", body, (register_decoder.decode(body),)) is None
    assert conductor.registrations == 1 and "i1" in conductor.registry.instances
    body = msgspec.json.encode(UNREG)
    assert _submit(j, "unregister", body, (unregister_decoder.decode(body),)) is True
    assert conductor.registrations == 0
    # an unknown instance: what applying it returned (the 404 of POST /unregister)
    assert _submit(j, "unregister", body, (unregister_decoder.decode(body),)) is False


def test_local_journal_refuses_an_unknown_kind(conductor):
    j = LocalJournal(conductor, conductor.thread)
    body = msgspec.json.encode(REG)
    with pytest.raises(UnknownMutation, match="'reregister'"):
        _submit(j, "reregister", body, (register_decoder.decode(body),))
    assert conductor.registrations == 0 and not conductor.registry.instances


def test_the_conductor_journal_is_local_by_default(conductor):
    assert isinstance(conductor.journal, LocalJournal)
    assert conductor.replicator is None


class RecordingJournal:
    """Journal double: records every submit, applies nothing."""

    replica = None

    def __init__(self) -> None:
        self.submits: list[tuple[str, bytes, tuple]] = []

    async def submit(self, kind: str, body: bytes, args: tuple) -> object:
        self.submits.append((kind, body, args))
        return False

    def stop(self) -> None:
        pass


def test_a_conductor_built_with_a_journal_sends_every_mutation_through_it():
    rec = RecordingJournal()
    built = []

    def make(c: Conductor) -> RecordingJournal:
        built.append(c)
        return rec

    c = Conductor(
        ConductorConfig(maintenance_interval=3600), subscriptions=NoSubscriptions, journal=make
    )
    assert built == [c] and c.journal is rec
    c.start()
    try:
        client = ft.TestClient(create_app(c))
        assert client.simulate_post("/register", json=REG).status_code == 201
        r = client.simulate_post("/unregister", json=UNREG)
        assert r.status_code == 404  # what the journal returned: not found
        assert [(k, msgspec.json.decode(b)) for k, b, _ in rec.submits] == [
            ("register", REG),
            ("unregister", UNREG),
        ]
        assert rec.submits[0][2] == (register_decoder.decode(msgspec.json.encode(REG)),)
        assert c.registrations == 0  # the double applied nothing
    finally:
        assert c.stop(5.0)


def test_the_journal_hands_its_source_role_to_the_subscriptions_at_construction():
    """The subscription manager is built with the conductor's ``journal.sources``: the
    local journal's owns every source and journals nothing; a replicated journal's (here
    a double) is the one the subscriptions append to. Nothing plugs itself in later."""
    from kvconductor.ingest.host import LOCAL_SOURCES

    local = Conductor(ConductorConfig(maintenance_interval=3600))
    local.start()
    try:
        assert local.journal.sources is LOCAL_SOURCES
        assert local.subs.journal is LOCAL_SOURCES
        assert LOCAL_SOURCES.claims(("i", 0, "tcp://h:1")) and not LOCAL_SOURCES.replicated
    finally:
        assert local.stop(5.0)

    rec = RecordingJournal()
    rec.sources = types.SimpleNamespace(replicated=True)
    c = Conductor(ConductorConfig(maintenance_interval=3600), journal=lambda c: rec)
    c.start()
    try:
        assert c.subs.journal is rec.sources
        body = msgspec.json.encode(UNREG)
        asyncio.run(c.mutate("unregister", body, unregister_decoder.decode(body)))
        assert len(rec.submits) == 1
    finally:
        assert c.stop(5.0)


def test_both_journals_apply_through_the_one_table(conductor, monkeypatch):
    """The local journal and the replicated log's apply (ValkeyJournal) both find an
    HTTP mutation in MUTATIONS: a kind changed there changes both."""
    from kvconductor.state.replica import ReplicaSettings, ValkeyJournal

    seen = []

    def apply(host, args):
        seen.append((host, args))
        return "applied"

    monkeypatch.setitem(
        journal_module.MUTATIONS,
        "register",
        Mutation("register", lambda body: ("decoded", body), apply),
    )
    local = LocalJournal(conductor, conductor.thread)
    assert _submit(local, "register", b"{}", ("parsed",)) == "applied"
    # a store that is never contacted: the client connects lazily
    valkey = ValkeyJournal(conductor, ReplicaSettings("redis://127.0.0.1:1/0"))
    assert conductor.call(valkey._apply_one, "register", b"{}") == "applied"
    assert apply_logged(conductor, "register", b"{}") == "applied"
    assert seen == [
        (conductor, ("parsed",)),
        (conductor, ("decoded", b"{}")),
        (conductor, ("decoded", b"{}")),
    ]
    assert conductor.registrations == 0

"""kvconductor/state/restore.py: a dump's registrations restored one by one, in process
(no sockets). A registration the loading conductor's flags refuse, past its
``--max-sources`` or whose subscription cannot be opened is skipped (one WARN, a count by
reason), its blocks dropped; every other registration and its blocks are loaded. So is a
registration record this version no longer accepts."""

from __future__ import annotations

import errno
import logging

import msgspec
import pytest
import xxhash
import zmq

from kvconductor.keys import Medium, WorkerKey
from kvconductor.schema import RegisterRequest
from kvconductor.state import dump
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.protocols import NoSubscriptions
from kvconductor.urls import UrlPolicy

BS = 4
KEEP = {"instance_id": "keep", "dp_rank": 0, "medium_endpoints": {"npu": "tcp://10.0.0.1:1"}}


class BusyPort(NoSubscriptions):
    """Subscriptions whose bind-mode URLs cannot be bound (a port in use)."""

    def replace(self, instance_id, dp_rank, contexts):
        if any(c.url.startswith("tcp://*") for c in contexts):
            raise zmq.ZMQError(errno.EADDRINUSE)
        return set()


def conductor(subs=NoSubscriptions, **config) -> Conductor:
    c = Conductor(ConductorConfig(maintenance_interval=3600, **config), subscriptions=subs)
    c.start()
    return c


def dump_of(gone: dict) -> bytes:
    """A dump of ``keep`` (2 HBM blocks) and ``gone`` (3 HBM blocks), both of qwen."""
    a = conductor(url_policy=UrlPolicy(allow_bind=True, allow_ipc=True))
    try:

        def fill() -> None:
            for body in (KEEP, gone):
                req = {"type": "vLLM", "modelname": "qwen", "block_size": BS, **body}
                a.register(msgspec.convert(req, RegisterRequest))
            idx = a.indexes[("qwen", "default")]
            idx.store_tokens(WorkerKey("keep", "", 0, Medium.NPU), None, [1, 2], range(8), BS)
            idx.store_tokens(WorkerKey("gone", "", 0, Medium.NPU), None, [3, 4, 5], range(12), BS)

        a.call(fill)
        return b"".join(dump.write_dump(a))
    finally:
        a.stop()


def blocks(c: Conductor, iid: str) -> int:
    idx = c.indexes[("qwen", "default")]
    return sum(idx.worker_blocks(k) for k in idx.workers_of(iid, 0))


@pytest.mark.parametrize(
    ("gone", "subs", "config", "reason", "why"),
    [
        (
            {"instance_id": "gone", "dp_rank": 0, "medium_endpoints": {"npu": "ipc:///e.sock"}},
            NoSubscriptions,
            {},
            "refused",
            "--allow-ipc-endpoints",
        ),
        (
            {
                "instance_id": "gone",
                "dp_rank": 0,
                "medium_endpoints": {"npu": "tcp://10.0.0.2:1", "cpu": "tcp://10.0.0.2:2"},
            },
            NoSubscriptions,
            {"max_sources": 1},
            "max_sources",
            "--max-sources",
        ),
        (
            {"instance_id": "gone", "dp_rank": 0, "medium_endpoints": {"npu": "tcp://*:5557"}},
            BusyPort,
            {"url_policy": UrlPolicy(allow_bind=True)},
            "unavailable",
            "Address already in use",
        ),
    ],
)
def test_skipped_registration_alone_is_lost(caplog, gone, subs, config, reason, why):
    data = dump_of(gone)
    b = conductor(subs, **config)
    try:
        with caplog.at_level(logging.WARNING, "kvconductor"):
            loaded = b.call(dump.load_dump, b, [data])
        assert loaded == {"sources": 0, "registrations": 2, "indexes": 1, "skipped": 1}
        assert sorted(b.registry.instances) == ["keep"]
        assert b.call(blocks, b, "keep") == 2
        assert b.call(blocks, b, "gone") == 0
        assert b.skipped_registrations == {
            "refused": 0,
            "max_sources": 0,
            "unavailable": 0,
            reason: 1,
        }
        warns = [r.getMessage() for r in caplog.records if "registration skipped" in r.getMessage()]
        assert len(warns) == 1
        assert f"instance_id=gone dp_rank=0 model=qwen reason={reason}: " in warns[0]
        assert why in warns[0]
        assert "open-file limit" not in warns[0]
    finally:
        b.stop()


def test_nothing_skipped_under_the_same_flags():
    gone = {"instance_id": "gone", "dp_rank": 0, "medium_endpoints": {"npu": "ipc:///e.sock"}}
    data = dump_of(gone)
    b = conductor(url_policy=UrlPolicy(allow_ipc=True))
    try:
        assert b.call(dump.load_dump, b, [data])["skipped"] == 0
        assert (b.call(blocks, b, "keep"), b.call(blocks, b, "gone")) == (2, 3)
        assert sum(b.skipped_registrations.values()) == 0
    finally:
        b.stop()


def test_a_registration_record_that_no_longer_validates_is_skipped(caplog):
    """A record this version refuses (a name over 400 characters) is skipped alone, by the
    names the record gives."""
    gone = {"instance_id": "gone", "dp_rank": 0, "medium_endpoints": {"npu": "tcp://10.0.0.2:1"}}
    records = list(dump._records([dump_of(gone)]))
    for r in records:
        if r.get("t") == "registration" and r["request"]["instance_id"] == "gone":
            r["request"]["modelname"] = "q" * 401
    body = b"".join(dump._frame(r) for r in records[:-1])
    data = body + dump._frame(dict(records[-1], checksum=xxhash.xxh3_64_intdigest(body)))
    b = conductor()
    try:
        with caplog.at_level(logging.WARNING, "kvconductor"):
            loaded = b.call(dump.load_dump, b, [data])
        assert loaded == {"sources": 0, "registrations": 2, "indexes": 1, "skipped": 1}
        assert sorted(b.registry.instances) == ["keep"]
        assert b.skipped_registrations["refused"] == 1
        # its blocks, in qwen's index whatever the record's model name says: dropped
        assert (b.call(blocks, b, "keep"), b.call(blocks, b, "gone")) == (2, 0)
        warns = [r.getMessage() for r in caplog.records if "registration skipped" in r.getMessage()]
        assert len(warns) == 1 and "instance_id=gone dp_rank=0 " in warns[0]
        assert "reason=refused: Expected `str` of length <= 400" in warns[0]
    finally:
        b.stop()

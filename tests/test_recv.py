"""kvconductor._recv: queued ZeroMQ messages received in C, the GIL held.

Its twin is pyzmq's own ``recv_multipart`` (what ``drain`` uses without it): every
message must come back exactly as ``recv_multipart`` gives it, frames and order, at any
limit, and a failing receive must report the errno libzmq gave.
"""

from __future__ import annotations

import errno
import itertools

import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor.ingest import replay

_recv = pytest.importorskip("kvconductor._recv")

_ids = itertools.count()

frames_st = st.lists(st.binary(max_size=300), min_size=1, max_size=5)
messages_st = st.lists(frames_st, max_size=40)


@pytest.fixture(scope="module")
def ctx():
    c = zmq.Context()
    yield c
    c.term()


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    addr = f"inproc://recv-{next(_ids)}"
    pull = ctx.socket(zmq.PULL)
    pull.bind(addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(addr)
    return push, pull


def _close(*socks: zmq.Socket) -> None:
    for s in socks:
        s.close(linger=0)


def _send_all(push: zmq.Socket, msgs: list[list[bytes]]) -> None:
    for m in msgs:
        push.send_multipart(m)


def _wait_queued(pull: zmq.Socket, msgs: list[list[bytes]]) -> None:
    """inproc delivers at once; a poll makes sure the first message is there."""
    if msgs:
        assert pull.poll(2000, zmq.POLLIN)


def test_available_from_pyzmqs_own_libzmq():
    assert _recv.AVAILABLE, _recv.WHY
    assert "libzmq" in _recv.WHY or _recv.WHY == "(global symbols)"
    assert replay._recv_messages is _recv.recv_messages


@settings(max_examples=60, deadline=None)
@given(msgs=messages_st, limit=st.integers(1, 50))
def test_same_messages_as_recv_multipart(ctx, msgs, limit):
    push, pull = _pair(ctx)
    push2, pull2 = _pair(ctx)
    try:
        _send_all(push, msgs)
        _send_all(push2, msgs)
        _wait_queued(pull, msgs)
        _wait_queued(pull2, msgs)
        got: list[list[bytes]] = []
        while True:
            out: list[list[bytes]] = []
            assert _recv.recv_messages(pull.underlying, limit, out) == 0
            assert len(out) <= limit
            got += out
            if len(out) < limit:
                break
        twin = []
        while True:
            try:
                twin.append(pull2.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                break
        assert got == twin == msgs
        assert all(type(f) is bytes for m in got for f in m)
    finally:
        _close(push, pull, push2, pull2)


def test_limit_empty_queue_and_large_frames(ctx):
    push, pull = _pair(ctx)
    try:
        out: list[list[bytes]] = []
        assert _recv.recv_messages(pull.underlying, 10, out) == 0 and out == []
        big = bytes(range(256)) * 4096  # 1 MiB, a zero-copy frame in libzmq
        msgs = [[b"t", i.to_bytes(8, "big"), big if i == 2 else b"p%d" % i] for i in range(7)]
        _send_all(push, msgs)
        _wait_queued(pull, msgs)
        assert _recv.recv_messages(pull.underlying, 3, out) == 0
        assert out == msgs[:3]
        assert _recv.recv_messages(pull.underlying, 0, out) == 0 and len(out) == 3
        assert _recv.recv_messages(pull.underlying, 100, out) == 0
        assert out == msgs
    finally:
        _close(push, pull)


def test_a_failed_receive_reports_libzmqs_errno(ctx):
    pub = ctx.socket(zmq.PUB)  # cannot receive: libzmq says ENOTSUP
    try:
        out: list[list[bytes]] = []
        assert _recv.recv_messages(pub.underlying, 5, out) == errno.ENOTSUP
        assert out == []
        with pytest.raises(ValueError):
            _recv.recv_messages(0, 5, out)
        errors: list[zmq.ZMQError] = []
        assert list(replay.drain(pub, 5, lambda: False, errors.append)) == []
        assert [e.errno for e in errors] == [errno.ENOTSUP]
    finally:
        pub.close(linger=0)


@pytest.mark.parametrize("compiled", [True, False])
def test_drain_stops_and_gives_the_same_either_way(ctx, monkeypatch, compiled):
    if not compiled:
        monkeypatch.setattr(replay, "_recv_messages", None)
    push, pull = _pair(ctx)
    try:
        msgs = [[b"", i.to_bytes(8, "big"), b"x" * i] for i in range(20)]
        _send_all(push, msgs)
        _wait_queued(pull, msgs)
        errors: list[zmq.ZMQError] = []
        assert list(replay.drain(pull, 8, lambda: False, errors.append)) == msgs[:8]
        seen: list[list[bytes]] = []
        stop = lambda: len(seen) >= 3
        for m in replay.drain(pull, 100, stop, errors.append):
            seen.append(m)
        assert seen == msgs[8:11] and errors == []
        assert list(replay.drain(pull, 100, lambda: True, errors.append)) == []
    finally:
        _close(push, pull)
    # a closed socket is never read (its messages went with it)
    assert list(replay.drain(pull, 5, lambda: False, errors.append)) == [] and errors == []

"""kvconductor.ingest.source: what a SUB's drain does between two messages.

A real PUB (an XPUB, to know the subscription arrived) sends to a :class:`SubSource` on a
real :class:`IngestThread`. In one process the ingest thread hands the GIL and the CPU to
the event loop after every message it handled (``os.sched_yield``); with ``--workers N``
it never does inside its shared write section (the workers' readers wait for that
section, not for the GIL).
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from kvconductor.ingest.source import SubSource
from kvconductor.ingest.thread import IngestThread

N = 60


class _Events:
    """What the source reports; at each message, the yields seen so far."""

    closed = False

    def __init__(self, yields: list[int], section: list[bool]) -> None:
        self.yields = yields
        self.section = section
        self.messages: list[tuple[list[bytes], int, bool]] = []
        self.done = threading.Event()

    def handshake(self) -> None:
        pass

    def disconnected(self) -> None:
        pass

    def message(self, frames: list[bytes]) -> None:
        self.messages.append((frames, len(self.yields), self.section[0]))
        if len(self.messages) == N:
            self.done.set()

    def receive_error(self, ex: zmq.ZMQError) -> None:
        raise AssertionError(ex)


class _Section:
    def __init__(self, section: list[bool]) -> None:
        self.section = section
        self.ticks = 0

    def __enter__(self) -> _Section:  # noqa: PYI034
        self.section[0] = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.section[0] = False

    def tick(self) -> None:
        self.ticks += 1


class _Shared:
    def __init__(self, section: list[bool]) -> None:
        self.sections: list[_Section] = []
        self.section = section

    def batch(self) -> _Section:
        s = _Section(self.section)
        self.sections.append(s)
        return s


def _run(monkeypatch: pytest.MonkeyPatch, shared: bool):
    section = [False]
    yields: list[int] = []
    events = _Events(yields, section)

    def sched_yield() -> None:
        # the messages handled when our ingest thread yielded (another thread left
        # running by an earlier test may yield too: not counted)
        if threading.get_ident() == thread.ident:
            yields.append(len(events.messages))

    writes = _Shared(section) if shared else None
    ctx = zmq.Context()
    thread = IngestThread(ctx)
    monkeypatch.setattr(os, "sched_yield", sched_yield)
    thread.start()
    pub = ctx.socket(zmq.XPUB)
    try:
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        src = SubSource(thread, events, writes)
        thread.submit(src.open, f"tcp://127.0.0.1:{port}", 1 << 20).result(5)
        assert pub.poll(5000, zmq.POLLIN), "the subscription never arrived"
        assert pub.recv() == b"\x01"
        sent = [[b"topic", i.to_bytes(8, "big"), b"payload %d" % i] for i in range(N)]
        for m in sent:
            pub.send_multipart(m)
        assert events.done.wait(10), f"{len(events.messages)} of {N} messages arrived"
        time.sleep(0.05)  # (a yield after the last message)
        thread.submit(src.close).result(5)
    finally:
        thread.stop()
        pub.close(linger=0)
        ctx.term()
    assert [m[0] for m in events.messages] == sent
    return events, yields, writes


def test_one_process_yields_after_every_message(monkeypatch):
    events, yields, _ = _run(monkeypatch, shared=False)
    # each message was handled with as many yields before it as messages before it
    assert [seen for _, seen, _ in events.messages] == list(range(N))
    assert yields == list(range(1, N + 1))


def test_workers_never_yield_inside_a_write_section(monkeypatch):
    events, yields, writes = _run(monkeypatch, shared=True)
    assert yields == []
    assert all(inside for _, _, inside in events.messages)
    assert writes is not None
    assert sum(s.ticks for s in writes.sections) == N

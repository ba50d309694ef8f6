"""The single ingest thread: ordering, errors, timers, sockets, stop, idle CPU."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest
import zmq

from kvconductor.ingest.thread import IngestThread, lower_priority
from tests.helpers.coro import run_coro


@pytest.fixture
def thread():
    t = IngestThread(zmq.Context.instance())
    t.start()
    yield t
    t.stop(5)


def test_work_runs_on_the_thread_in_order(thread):
    seen = []
    futs = [
        thread.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        for i in range(200)
    ]
    for f in futs:
        f.result(5)
    assert [i for i, _ in seen] == list(range(200))
    assert {n for _, n in seen} == {"kv-ingest"}
    assert thread.call(thread.on_thread) is True and not thread.on_thread()


def test_exceptions_reach_the_caller_and_the_thread_survives(thread):
    def boom():
        raise ValueError("bad event")

    with pytest.raises(ValueError, match="bad event"):
        thread.call(boom, timeout=5)
    assert thread.call(lambda: 42, timeout=5) == 42


def test_async_run(thread):
    async def main():
        return await thread.run(lambda a, b: a * b, 6, 7)

    assert run_coro(main()) == 42


def test_timers_fire_in_deadline_order(thread):
    fired = []
    done = threading.Event()

    def schedule():
        thread.call_later(0.05, lambda: fired.append("b"))
        thread.call_later(0.01, lambda: fired.append("a"))
        thread.call_later(0.08, done.set)

    thread.call(schedule)
    assert done.wait(5)
    assert fired == ["a", "b"]


def test_socket_handlers_and_their_errors(thread):
    ctx = zmq.Context.instance()
    got = []

    def setup():
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")

        def on_msg(sock):
            msg = sock.recv(zmq.NOBLOCK)
            if msg == b"raise":
                raise RuntimeError("handler bug")
            got.append(msg)

        thread.add_socket(pull, on_msg)
        return port

    port = thread.call(setup)
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://127.0.0.1:{port}")
    for m in (b"one", b"raise", b"two"):
        push.send(m)
    deadline = time.monotonic() + 5
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    push.close(linger=0)
    assert got == [b"one", b"two"]
    assert thread.errors == 1  # logged and counted, the thread kept going


def _wait_for(cond, secs=5.0):
    deadline = time.monotonic() + secs
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.01)
    return cond()


def test_socket_news_taken_in_before_it_was_added_is_not_missed(thread):
    """The loop waits on each ZeroMQ socket's ZMQ_FD, which signals only news not yet taken
    in: messages already queued when the socket is added (here taken in by a ``poll`` before
    ``add_socket``) are delivered, and a handler that takes one message per call is called
    again until its socket is empty, without new traffic to wake the thread."""
    ctx = zmq.Context.instance()
    got = []

    def setup():
        pull = ctx.socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push = ctx.socket(zmq.PUSH)
        push.connect(f"tcp://127.0.0.1:{port}")
        for i in range(5):
            push.send(b"%d" % i)
        assert pull.poll(5000) == zmq.POLLIN  # the fd's signal is consumed here
        thread.add_socket(pull, lambda sock: got.append(sock.recv(zmq.NOBLOCK)))
        return pull, push

    pull, push = thread.call(setup)
    try:
        assert _wait_for(lambda: len(got) == 5), got
        assert got == [b"0", b"1", b"2", b"3", b"4"]
    finally:
        thread.call(lambda: (thread.remove_socket(pull), pull.close(0), push.close(0)))


def test_handlers_run_in_the_order_sockets_were_added(thread):
    """Sockets ready in the same round are handled in the order they were added (as with
    a zmq.Poller), plain fds included."""
    ctx = zmq.Context.instance()
    order = []
    r, w = os.pipe()

    def setup():
        socks = []
        for i in range(3):
            a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
            a.bind(f"inproc://order-{i}")
            b.connect(f"inproc://order-{i}")
            socks.append((a, b))
        # added: pair 2, the pipe, pair 0, pair 1; readable all at once below
        for i, x in ((2, socks[2][0]), ("fd", r), (0, socks[0][0]), (1, socks[1][0])):

            def handler(sock, i=i):
                order.append(i)
                if isinstance(sock, int):
                    os.read(sock, 16)
                else:
                    sock.recv(zmq.NOBLOCK)

            thread.add_socket(x, handler)
        for _, b in socks:
            b.send(b"x")
        os.write(w, b"x")
        return socks

    socks = thread.call(setup)
    try:
        assert _wait_for(lambda: len(order) == 4), order
        assert order == [2, "fd", 0, 1]
    finally:

        def teardown():
            thread.remove_socket(r)
            for a, b in socks:
                thread.remove_socket(a)
                a.close(0)
                b.close(0)

        thread.call(teardown)
        os.close(r)
        os.close(w)


def test_stop_rejects_later_work():
    t = IngestThread(zmq.Context.instance())
    t.start()
    assert t.stop(5)
    assert not t.is_alive()
    with pytest.raises(RuntimeError, match="stopped"):
        t.submit(lambda: 1).result(1)


def _thread_cpu(native_id: int) -> float:
    with open(f"/proc/self/task/{native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="needs /proc")
def test_idle_thread_uses_no_cpu(thread):
    """No busy spin (the reference spun one core per subscriber): an idle second costs at most
    a few ticks."""
    tid = thread.call(threading.get_native_id)
    c0 = _thread_cpu(tid)
    time.sleep(1.0)
    assert _thread_cpu(tid) - c0 <= 0.05


def test_wake_after_stop_never_writes_to_a_reused_fd():
    """After the thread exits its wake pipe's numbers go back to the OS; a late wake-up
    (a submit racing the stop) must not write into whatever file reuses them."""
    t = IngestThread()
    t.start()
    old_w = t._wake_w
    assert t.stop(5.0)
    pipes = []
    try:
        while not any(old_w in p for p in pipes) and len(pipes) < 64:
            pipes.append(os.pipe())
        ((r, w),) = [p for p in pipes if old_w in p]
        t._wake()
        assert t.submit(lambda: 1).exception(1) is not None
        os.set_blocking(r, False)
        if w == old_w:  # the old write end is now a live pipe: nothing arrived
            with pytest.raises(BlockingIOError):
                os.read(r, 16)
    finally:
        for p in pipes:
            for fd in p:
                os.close(fd)


def _own_nice() -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a thread's own nice: Linux")
@pytest.mark.parametrize("nice", [0, 5])
def test_nice_lowers_the_ingest_threads_priority_only(nice):
    """``IngestThread(nice=N)``: the thread's own nice value is the process's plus N
    (capped at 19, the lowest), read on the thread; the threads that started it keep theirs."""
    before = _own_nice()
    t = IngestThread(zmq.Context.instance(), nice=nice)
    t.start()
    try:
        assert t.call(_own_nice) == min(19, before + nice)
        assert t.call(lambda: (lower_priority(0), _own_nice())) == (before + nice, before + nice)
    finally:
        t.stop(5)
    assert _own_nice() == before


def test_a_refused_priority_change_is_logged_and_changes_nothing(monkeypatch, caplog):
    """A sandbox that refuses ``setpriority``: a WARN naming the thread, the thread runs on."""

    def refuse(*args):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    t = IngestThread(zmq.Context.instance(), nice=5, name="kv-ingest-refused")
    with caplog.at_level("WARNING", "kvconductor.ingest"):
        t.start()
        try:
            assert t.call(lambda: 41 + 1) == 42
        finally:
            t.stop(5)
    if sys.platform.startswith("linux"):
        assert any(
            "kv-ingest-refused: could not lower its priority by 5" in r.getMessage()
            for r in caplog.records
        )

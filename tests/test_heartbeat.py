"""The owner's heartbeat of its workers (:mod:`kvconductor.serve.heartbeat`): one
worker's pings without a clock, the owner's watch over real socket pairs and a real
child process, and the worker's answer from its event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import socket
import subprocess
import sys
import threading
import time
import types

from kvconductor.serve import heartbeat, worker
from kvconductor.serve.heartbeat import PING, PONG, Heartbeat, Watch, timeout_for


def test_the_bound_follows_reader_stall_ms_with_a_floor():
    assert timeout_for(500) == 0.5
    assert timeout_for(300) == heartbeat.MIN_TIMEOUT == 0.5
    assert timeout_for(2000) == 2.0
    assert timeout_for(0) is None  # --reader-stall-ms 0: wait without bound, kill none


def test_one_ping_out_at_a_time_and_silence_counts_from_it():
    hb = Heartbeat()
    assert hb.due(10.0) and hb.silent(10.0) == 0.0
    hb.sent(10.0)
    assert not hb.due(10.5)  # unanswered: no second ping
    assert abs(hb.silent(10.4) - 0.4) < 1e-9
    assert not hb.expired(10.5, 0.5) and hb.expired(10.51, 0.5)
    assert not hb.expired(99.0, None)
    hb.answered()
    assert hb.silent(10.6) == 0.0 and not hb.due(10.04) and hb.due(10.1)
    hb.sent(11.0)
    hb.forgive(12.0)  # the owner itself stalled: counted again from now
    assert hb.silent(12.0) == 0.0 and hb.due(12.0)
    hb.killed = True
    assert not hb.due(20.0) and not hb.expired(20.0, 0.5)


@dataclasses.dataclass
class _Slot:
    name: str
    proc: subprocess.Popen | None
    control: socket.socket | None
    heartbeat: Heartbeat | None


def _drain(slot: _Slot) -> None:
    """The owner's reading of a socket pair (answers only, here)."""
    assert slot.control is not None
    try:
        data = slot.control.recv(64)
    except BlockingIOError:
        return
    if PONG in data and slot.heartbeat is not None:
        slot.heartbeat.answered(data.count(PONG))


def test_the_watch_pings_and_kills_only_the_silent_worker():
    procs = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(2)
    ]
    pairs = [socket.socketpair() for _ in procs]
    slots = []
    for i, (proc, (owner_end, _)) in enumerate(zip(procs, pairs, strict=True)):
        owner_end.setblocking(False)
        slots.append(_Slot(f"worker-{i + 1}", proc, owner_end, Heartbeat()))
    answering, silent = slots
    watch = Watch(500, _drain)
    try:
        now = 100.0
        watch.check(slots, now)
        for _, worker_end in pairs:
            assert worker_end.recv(8) == PING
        for step in range(1, 7):  # 0.1 s ticks: worker-1 answers every ping
            pairs[0][1].send(PONG)
            now += 0.1
            watch.check(slots, now)
            assert answering.heartbeat is not None and answering.heartbeat.answers == step
            assert pairs[0][1].recv(8) == PING  # the next one
        # worker-2 read its one ping and answered none: silent 0.6 s > 0.5 s
        assert watch.kills == 1 and silent.heartbeat is not None and silent.heartbeat.killed
        assert silent.proc is not None and silent.proc.wait(5) == -signal.SIGKILL
        assert watch.reaped(silent.proc.pid, -signal.SIGKILL)
        assert not watch.reaped(silent.proc.pid, -signal.SIGKILL)  # told once
        assert procs[0].poll() is None and not watch.reaped(procs[0].pid, 0)
        info = watch.info()
        assert (info["interval_ms"], info["timeout_ms"], info["kills"]) == (100, 500, 1)
        (row,) = info["recent_kills"]
        assert (row["worker"], row["pid"], row["silent_ms"]) == ("worker-2", procs[1].pid, 600.0)
        assert row["state"] in ("S", "Z", "R")  # sleeping when killed
        # the owner's own loop stalled 2 s: nobody is killed for that, a new ping goes out
        answering.heartbeat.sent(now)
        now += 2.0
        watch.check([answering], now)
        assert watch.kills == 1 and answering.heartbeat.silent(now) == 0.0
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
        for a, b in pairs:
            a.close()
            b.close()


def test_no_kill_with_reader_stall_ms_0():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    a, b = socket.socketpair()
    a.setblocking(False)
    try:
        slot = _Slot("worker-1", proc, a, Heartbeat())
        watch = Watch(0, _drain)
        for i in range(20):
            watch.check([slot], 100.0 + 0.1 * i)
        assert watch.kills == 0 and proc.poll() is None
        assert slot.heartbeat is not None and round(slot.heartbeat.silent(102.0), 1) == 2.0
        assert watch.info()["timeout_ms"] is None
    finally:
        proc.kill()
        proc.wait(5)
        a.close()
        b.close()


def test_the_worker_answers_from_its_event_loop_only(monkeypatch):
    """A worker's link answers each ping on its serving loop: while the loop is blocked,
    nothing comes back; once it runs, the answers do."""
    owner_end, worker_end = socket.socketpair()
    owner_end.settimeout(5)
    link = worker._OwnerLink(worker_end)

    def gone(code: int) -> None:  # the owner's end closes at the end: the link would exit
        raise SystemExit(code)

    monkeypatch.setattr(worker.os, "_exit", gone)
    monkeypatch.setattr(worker.logging, "shutdown", lambda: None)
    exits: list[int] = []

    def watch() -> None:
        try:
            link._watch()
        except SystemExit as ex:
            exits.append(int(ex.code or 0))

    watcher = threading.Thread(target=watch, daemon=True)

    async def main() -> None:
        loop = asyncio.get_running_loop()
        link.server = types.SimpleNamespace(loop=loop, should_exit=False, force_exit=False)
        watcher.start()
        owner_end.send(PING)
        got = await loop.run_in_executor(None, owner_end.recv, 8)
        assert got == PONG
        owner_end.send(PING)
        time.sleep(0.3)  # the loop is blocked: the ping waits
        owner_end.setblocking(False)
        try:
            owner_end.recv(8)
            raise AssertionError("answered while the loop was blocked")
        except BlockingIOError:
            pass
        owner_end.settimeout(5)
        got = await loop.run_in_executor(None, owner_end.recv, 8)
        assert got == PONG

    try:
        asyncio.run(main())
    finally:
        owner_end.close()
        watcher.join(5)
        worker_end.close()
    assert not watcher.is_alive() and exits == [1]  # the owner gone: exit status 1

"""kvconductor.logs: the recent-warnings ring behind ``/workers.recent_warnings``."""

from __future__ import annotations

import logging
import threading

import falcon.testing as ft
import msgspec

from kvconductor.http.api import create_app
from kvconductor.logs import (
    MAX_MESSAGE,
    RecentWarnings,
    _Formatter,
    _JsonFormatter,
    escape_controls,
    level_name,
    utc,
)
from kvconductor.state.conductor import Conductor, ConductorConfig


def test_utc_and_level_names():
    assert utc(0.25) == "1970-01-01T00:00:00.250000Z"
    assert utc(365 * 86400 + 3600 + 61.5) == "1971-01-01T01:01:01.500000Z"
    assert level_name(logging.WARNING, "WARNING") == "WARN"
    assert level_name(logging.CRITICAL, "CRITICAL") == "ERROR"
    assert level_name(logging.ERROR, "ERROR") == "ERROR"


def test_ring_keeps_the_last_warnings_only():
    ring = RecentWarnings(capacity=3)
    ring.install("kvconductor.test_logs")
    log = logging.getLogger("kvconductor.test_logs.child")  # a child propagates to it
    try:
        log.info("not kept")
        for i in range(5):
            log.warning("w%d", i)
        log.error("boom %s", "x" * (2 * MAX_MESSAGE))
    finally:
        ring.uninstall()
    log.warning("after uninstall")
    got = ring.snapshot()
    assert [g["message"] for g in got[:2]] == ["w3", "w4"]
    assert [g["level"] for g in got] == ["WARN", "WARN", "ERROR"]
    assert len(got[2]["message"]) == MAX_MESSAGE and got[2]["message"].endswith("x...")
    assert all(g["ts"].endswith("Z") and len(g["ts"]) == 27 for g in got)
    got[0]["message"] = "changed"  # a copy
    assert ring.snapshot()[0]["message"] == "w3"


def test_ring_from_many_threads():
    ring = RecentWarnings(capacity=50)
    ring.install("kvconductor.test_logs_threads")
    log = logging.getLogger("kvconductor.test_logs_threads")
    seen: list[int] = []

    def write(t: int) -> None:
        for i in range(200):
            log.warning("t%d-%d", t, i)

    def read() -> None:
        for _ in range(200):
            seen.append(len(ring.snapshot()))

    threads = [threading.Thread(target=write, args=(t,)) for t in range(4)]
    threads.append(threading.Thread(target=read))
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        ring.uninstall()
    got = [g["message"] for g in ring.snapshot()]
    assert len(got) == 50 and max(seen) <= 50
    # Each thread's records stay in order; each thread's last one is among those kept.
    for t in range(4):
        mine = [int(m.split("-")[1]) for m in got if m.startswith(f"t{t}-")]
        assert mine == sorted(mine)
    assert got[-1].endswith("-199")


def test_workers_lists_the_conductors_warnings_while_it_runs():
    c = Conductor(ConductorConfig(index_impl="py", maintenance_interval=3600))
    log = logging.getLogger("kvconductor.ingest")
    log.warning("before start")  # not collected
    c.start()
    try:
        client = ft.TestClient(create_app(c))
        log.warning("dropped (%s) from %s", "parent_not_found", "vllm-1/dp0@tcp://h:1")
        logging.getLogger("kvconductor").info("an info line")
        r = client.simulate_post("/query", json={"model": "m", "block_size": 4, "token_ids": [1]})
        assert r.status_code == 404  # unknown index: an INFO line, not a warning
        got = client.simulate_get("/workers").json["recent_warnings"]
        assert [(g["level"], g["message"]) for g in got] == [
            ("WARN", "dropped (parent_not_found) from vllm-1/dp0@tcp://h:1")
        ]
        for i in range(60):
            log.warning("w%d", i)
        got = client.simulate_get("/workers").json["recent_warnings"]
        assert [g["message"] for g in got] == [f"w{i}" for i in range(10, 60)]
    finally:
        assert c.stop(5.0)
    log.warning("after stop")
    assert [g["message"] for g in c.workers()["recent_warnings"]][-1] == "w59"


def test_control_characters_are_escaped_in_every_written_message():
    """No value can forge a line: C0 (newline, NUL, ESC), DEL, C1 and U+2028/U+2029 are
    written as escapes by the text and JSON formats and kept so in the ring."""
    forged = "id=x\n2026-01-01T00:00:00.000000Z ERROR forged\x00\x1b[31m\x7f\x85\u2028é\t"
    want = "id=x\\x0a2026-01-01T00:00:00.000000Z ERROR forged\\x00\\x1b[31m\\x7f\\x85\\u2028é\\x09"
    assert escape_controls(forged) == want
    assert escape_controls("plain é ✓") == "plain é ✓"
    rec = logging.LogRecord("kvconductor.t", logging.WARNING, __file__, 1, "%s", (forged,), None)
    text = _Formatter().format(rec)
    assert "\n" not in text and text.endswith(" WARN " + want)
    assert msgspec.json.decode(_JsonFormatter().format(rec))["message"] == want
    ring = RecentWarnings()
    ring.handle(rec)
    assert ring.snapshot()[0]["message"] == want

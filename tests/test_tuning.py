"""The process tuning of a serving process (kvconductor.serve.tuning): glibc's heap trim
and malloc thresholds, the ZeroMQ context's size, and how the composition root hands
them to the conductor. The open-file limit: tests/test_fd_limit.py."""

from __future__ import annotations

import sys
import time

import pytest
import zmq

from kvconductor.serve import bootstrap, tuning
from kvconductor.serve.settings import Settings
from kvconductor.state.conductor import Conductor, ConductorConfig
from kvconductor.state.protocols import NoSubscriptions

_TRIM_PROBE = """
import gc
from kvconductor.serve.tuning import _TRIM, trim_heap
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS"))
assert _TRIM is not None, "malloc_trim not found (glibc is the supported platform)"
before = rss()
chunks = [bytes(4096) for _ in range(40_000)]  # ~164 MB of malloc'd blocks
keep = chunks[::16]  # pins every 16th: the freed runs are not at the heap's top
del chunks
gc.collect()
held = rss() - before
trim_heap()
print(held, rss() - before, len(keep))
"""


def test_trim_heap_returns_freed_memory_to_the_system():
    """Freed 4 kB blocks between live ones stay with the process (glibc trims only its
    heap's top); trim_heap gives them back. The ingest thread calls it every TRIM_SECS.
    In a fresh interpreter, so that no earlier test's freed memory is reused."""
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", _TRIM_PROBE], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    held, after, kept = map(int, out.stdout.split())
    assert held > 120_000_000, held  # freed, yet still resident
    assert after < held / 3, (held, after)
    assert kept == 2500


_MALLINFO = """
import ctypes, sys
from kvconductor.serve.tuning import tune_malloc
class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]
mallinfo2 = ctypes.CDLL(None).mallinfo2
mallinfo2.restype = MI
tuned = sys.argv[1] == "1" and tune_malloc()
before = mallinfo2().hblkhd
buf = bytearray(4 << 20)
print(int(tuned), mallinfo2().hblkhd - before)
"""


def test_tune_malloc_keeps_large_answers_in_the_heap():
    """A 4 MiB buffer (a large answer) is a fresh mmap with glibc's defaults and comes
    from the heap once tuned (freed pages are reused instead of faulted in again)."""
    import ctypes
    import subprocess

    if not hasattr(ctypes.CDLL(None), "mallinfo2"):
        pytest.skip("not glibc >= 2.33")
    out = {}
    for tuned in ("0", "1"):
        r = subprocess.run(
            [sys.executable, "-c", _MALLINFO, tuned], capture_output=True, text=True, check=True
        )
        out[tuned] = tuple(int(x) for x in r.stdout.split())
    assert out["0"][0] == 0 and out["0"][1] >= 4 << 20  # mmapped
    assert out["1"] == (1, 0)  # tuned: from the heap


def test_zmq_context_is_sized_for_max_sources():
    """libzmq's default of 1023 sockets capped a process at 341 subscriptions."""
    ctx = tuning.zmq_context(4096)
    try:
        assert ctx.get(zmq.MAX_SOCKETS) == tuning.SOCKETS_PER_SOURCE * 4096 + 256
        assert ctx.get(zmq.IO_THREADS) == 4
    finally:
        ctx.term()


def test_io_threads_grow_with_max_sources_up_to_four():
    """One libzmq I/O thread per 1,024 subscriptions (a heartbeat's timer cancel walks
    every timer of its I/O thread), 1 to 4."""
    got = {n: tuning.io_threads(n) for n in (0, 1, 16, 1024, 1025, 2048, 3000, 4096, 20_000)}
    assert got == {0: 1, 1: 1, 16: 1, 1024: 1, 1025: 2, 2048: 2, 3000: 3, 4096: 4, 20_000: 4}
    ctx = tuning.zmq_context(16)
    try:
        assert ctx.get(zmq.IO_THREADS) == 1
    finally:
        ctx.term()


def test_heap_trim_trims_at_most_every_trim_secs(monkeypatch):
    calls: list[int] = []
    monkeypatch.setattr(tuning, "trim_heap", lambda: calls.append(1))
    trim = tuning.HeapTrim()
    t0 = trim.last
    trim(t0 + 1.0)
    assert calls == []
    trim(t0 + tuning.TRIM_SECS)
    trim(t0 + tuning.TRIM_SECS + 1.0)
    assert calls == [1]
    trim(t0 + 2 * tuning.TRIM_SECS + 0.5)
    assert calls == [1, 1]


def test_the_conductor_calls_the_heap_trim_it_is_handed_on_its_source_check(monkeypatch):
    """The ingest thread calls ``heap_trim(now)`` on every source check; without one
    (tests, the dump check) nothing is trimmed."""
    monkeypatch.setattr("kvconductor.state.conductor.SOURCE_CHECK_SECS", 0.05)
    seen: list[float] = []
    c = Conductor(
        ConductorConfig(maintenance_interval=3600),
        subscriptions=lambda thread, conductor: NoSubscriptions(),
        heap_trim=seen.append,
    )
    c.start()
    try:
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        c.stop()
    assert len(seen) >= 2 and all(isinstance(t, float) for t in seen)


def test_the_composition_root_hands_the_conductor_its_tuning(monkeypatch):
    """The service's conductor: an ingest thread whose ZeroMQ context is sized for
    --max-sources, and a HeapTrim (before issue 37 the conductor made both itself)."""
    monkeypatch.setattr(bootstrap.sys, "setswitchinterval", lambda v: None)
    monkeypatch.setattr(bootstrap, "raise_fd_limit", lambda *a: None)
    monkeypatch.setattr(bootstrap, "tune_malloc", lambda: None)
    handed: dict[str, object] = {}

    def conductor(*args, **kwargs):
        handed.update(kwargs)
        return Conductor(*args, **kwargs)

    monkeypatch.setattr(bootstrap, "Conductor", conductor)
    service = bootstrap.build_service(Settings(max_sources=1000), "single")
    assert service.conductor is not None
    try:
        assert service.conductor.thread is handed["thread"]
        assert service.conductor.thread.ctx.get(zmq.MAX_SOCKETS) == 3 * 1000 + 256
        assert isinstance(handed["heap_trim"], tuning.HeapTrim)
    finally:
        service.conductor.stop()

"""Process tuning of a serving process: open files, ZeroMQ context sizing, glibc malloc.

The composition root (:mod:`kvconductor.serve.bootstrap`) calls these before it builds
the conductor: :func:`raise_fd_limit` and :func:`tune_malloc` at start
(:func:`kvconductor.serve.bootstrap.tune_process`), :func:`zmq_context` for the
conductor's ingest thread, and :class:`HeapTrim` handed to the conductor, whose ingest
thread calls it on every source check (:func:`trim_heap` every :data:`TRIM_SECS`). The
``--workers N`` processes, which have no ingest thread, trim from their event loop
(:mod:`kvconductor.serve.single`).
"""

from __future__ import annotations

import ctypes
import logging
import time
from collections.abc import Callable

import zmq

log = logging.getLogger("kvconductor")

#: ZeroMQ sockets per subscription: the SUB, and the PAIR pair of its monitor.
SOCKETS_PER_SOURCE = 3
#: File descriptors per subscription: one per socket (its mailbox) and its TCP connection.
FDS_PER_SOURCE = 4
#: File descriptors of the process itself (listener, epoll, logs, threads), with room to spare.
FD_HEADROOM = 256


#: Added to the one-process server's ingest thread's nice value
#: (:func:`kvconductor.ingest.thread.lower_priority`): the event loop answering queries gets
#: the CPU first. Not with ``--workers N``: the owner's ingest thread holds write sections
#: the workers' readers wait for.
INGEST_NICE = 5

#: Subscriptions per ZeroMQ I/O thread that :func:`zmq_context` plans for, and its most
#: I/O threads.
SOURCES_PER_IO_THREAD = 1024
MAX_IO_THREADS = 4


def io_threads(max_sources: int) -> int:
    """libzmq I/O threads for ``max_sources`` subscriptions: one per
    :data:`SOURCES_PER_IO_THREAD`, at least 1, at most :data:`MAX_IO_THREADS`.

    PERF: each subscription's ZMTP heartbeat (a PING a second,
    :data:`kvconductor.ingest.source.HEARTBEAT_IVL_MS`) cancels its timeout timer when the
    PONG comes back, and libzmq cancels a timer by walking every timer of its I/O thread
    (``poller_base_t::cancel_timer``, "O(n). We assume it is rarely used"): one I/O
    thread for every subscription costs the square of the subscriptions. Measured with
    idle sources (``bench/heartbeat_cost.py``): 4,096 on one I/O thread took 24 % of a
    core, on 4 I/O threads 12 % (what is left is the PINGs themselves, linear); the
    subscriptions are spread over the I/O threads by libzmq (the least loaded)."""
    return max(1, min(MAX_IO_THREADS, -(-max_sources // SOURCES_PER_IO_THREAD)))


def zmq_context(max_sources: int) -> zmq.Context:
    """A ZeroMQ context sized for ``max_sources`` subscriptions (plus replay DEALERs):
    its sockets, and its I/O threads (:func:`io_threads`).

    libzmq's default of 1023 sockets capped a process at 341 subscriptions.
    """
    ctx = zmq.Context(io_threads=io_threads(max_sources))
    ctx.set(zmq.MAX_SOCKETS, SOCKETS_PER_SOURCE * max_sources + 256)
    return ctx


def fds_needed(max_sources: int, max_connections: int = 1024) -> int:
    """Open files the process needs: subscriptions, HTTP connections, headroom."""
    return FDS_PER_SOURCE * max_sources + max_connections + FD_HEADROOM


def open_file_limits() -> tuple[int | None, int | None]:
    """The soft and hard ``RLIMIT_NOFILE`` (``None``: unlimited, or not POSIX)."""
    try:
        import resource
    except ImportError:  # not POSIX
        return None, None
    inf = resource.RLIM_INFINITY
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    return (None if soft == inf else soft), (None if hard == inf else hard)


def raise_fd_limit(max_sources: int, max_connections: int) -> int | None:
    """Raise the soft ``RLIMIT_NOFILE`` for ``--max-sources`` and ``--max-connections``
    (docs/operations.md, "Open files"); both ``kv-conductor`` and the gunicorn app call it
    at start. Returns the soft limit after the change (``None``: unlimited or not POSIX).

    Like Go's runtime, the soft limit is raised to the hard limit (to
    :func:`fds_needed` when the hard limit is unlimited). When it stays below what is
    needed, one WARN says so; the HTTP connection cap is then fitted by
    :func:`kvconductor.serve.single.fit_connection_cap`.
    """
    soft, hard = open_file_limits()
    if soft is None:
        return None
    import resource

    needed = fds_needed(max_sources, max_connections)
    preferred = needed if hard is None else hard
    # Fallbacks for a system that refuses the preferred value (a soft limit above
    # OPEN_MAX, say): what is needed, then at least the HTTP connections.
    targets: list[int] = []
    for t in (preferred, needed, max_connections + FD_HEADROOM):
        if soft < t and (hard is None or t <= hard) and t not in targets:
            targets.append(t)
    error = None
    for target in targets:
        try:
            resource.setrlimit(
                resource.RLIMIT_NOFILE, (target, resource.RLIM_INFINITY if hard is None else hard)
            )
        except (ValueError, OSError) as ex:
            error = error or ex
            continue
        log.info("raised the open-file limit from %d to %d", soft, target)
        soft = target
        break
    else:
        if error is not None:
            log.warning(
                "could not raise the open-file limit from %d to %d: %s", soft, preferred, error
            )
    if soft < needed:
        log.warning(
            "open-file limit %d is below the %d that --max-sources needs; "
            "registrations past the limit will be refused with 503",
            soft,
            needed,
        )
    return soft


#: Seconds between two :func:`trim_heap` calls of the ingest thread.
TRIM_SECS = 10.0


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None).malloc_trim  # glibc only
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    return fn


_TRIM = _malloc_trim()


def trim_heap() -> None:
    """Give freed heap memory back to the system (glibc ``malloc_trim(0)``; a no-op
    elsewhere).

    PERF: engine messages wait in ZeroMQ's queue while the ingest thread catches up, and
    are freed once applied; glibc keeps the freed pages (in the middle of its heaps,
    where its automatic trimming never looks), so after a burst the process stayed about
    as large as the burst: 158 B of RSS per (worker, block) for 57 B of index after 1M
    blocks, 50 B with this every 10 s (docs/performance.md, "Server memory"). A few
    milliseconds on the ingest thread."""
    if _TRIM is not None:
        _TRIM(0)


class HeapTrim:
    """:func:`trim_heap` at most every ``every`` seconds: handed to the conductor
    (``Conductor(heap_trim=...)``), whose ingest thread calls it with
    ``time.monotonic()`` on every source check."""

    def __init__(self, every: float = TRIM_SECS) -> None:
        self.every = every
        self.last = time.monotonic()

    def __call__(self, now: float) -> None:
        if now - self.last >= self.every:
            self.last = now
            trim_heap()


#: glibc ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: :func:`tune_malloc`: blocks below this come from the heap, and the heap's top shrinks
#: only past this much free memory (the periodic :func:`trim_heap` still returns it).
MALLOC_KEEP_BYTES = 32 << 20


def tune_malloc() -> bool:
    """Keep large short-lived buffers in glibc's heap (server processes, at start).

    PERF: an answer listing 7,000 (instance, DP) rows is a 0.6-0.8 MB ``bytes``; with
    glibc's defaults each one came from fresh pages (an mmap, or a heap top trimmed
    after the previous free), ~270 page faults per query: 4-6 ms on the development
    machine against 0.4 ms to encode it (docs/performance.md, "Answers with thousands of
    holders"). With both thresholds at :data:`MALLOC_KEEP_BYTES` the freed pages are
    reused; :func:`trim_heap` every ``TRIM_SECS`` still gives them back when idle.
    False (nothing changed) without glibc."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(
        mallopt(_M_MMAP_THRESHOLD, MALLOC_KEEP_BYTES)
        and mallopt(_M_TRIM_THRESHOLD, MALLOC_KEEP_BYTES)
    )

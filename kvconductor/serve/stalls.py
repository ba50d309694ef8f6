"""The ``--workers N`` owner's view of workers stalled inside a read of the shared index.

The ingest thread (the shared lock, :mod:`kvconductor._shlock`) notices a reader stalled
past ``--reader-stall-ms``, kills it when it is a worker of this owner and records it in
the lock's stall log; :class:`StallLog` (the owner's main thread) logs each entry at
WARN, reminds every :data:`STALL_NAG_SECS` while the ingest thread still waits for one
that is not dead, tells the owner which exits were such kills (restarted after 1 s, their
back-off unchanged) and gives ``/workers`` ``processes.shared_lock``.
"""

from __future__ import annotations

import collections
import logging
import signal
import threading
import time
from typing import Any

from kvconductor.serve.heartbeat import STATES, proc_state

log = logging.getLogger("kvconductor.cluster")

#: While the ingest thread waits for a stalled reader that is not dead (not killable,
#: or not dying), a WARN this often (seconds).
STALL_NAG_SECS = 5.0
#: Stalls kept for ``/workers`` (``processes.shared_lock.recent_stalls``).
RECENT_STALLS = 16


class StallLog:
    """Stalls of the shared lock's readers (:meth:`check`, :meth:`reaped`: the owner's
    main thread; :meth:`info`: any thread). ``names``: pid -> worker name, the owner's."""

    def __init__(self, shared: Any, reader_stall_ms: int, names: dict[int, str]) -> None:
        self.shared = shared
        self.reader_stall_ms = reader_stall_ms
        self._names = names
        self._lock = threading.Lock()  # the deque: read by /workers
        self._stall_seq = 0  # last entry of the lock's stall log logged
        self._stall_killed: dict[int, dict[str, Any]] = {}  # pid -> its stall, killed
        self._recent_stalls: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=RECENT_STALLS
        )
        self._stall_nagged = 0.0

    def reaped(self, pid: int, code: int) -> bool:
        """Worker ``pid`` exited with ``code``: whether the ingest thread killed it for
        stalling the shared index."""
        return self._stall_killed.pop(pid, None) is not None and code == -signal.SIGKILL

    def check(self) -> None:
        """Log what the ingest thread did about readers of the shared lock stalled past
        ``--reader-stall-ms`` (the lock's stall log), and keep reminding while it still
        waits for one that is not dead."""
        if self.shared is None:
            return
        lock = self.shared.lock
        for e in lock.stall_log(after=self._stall_seq):
            self._stall_seq = e["seq"]
            pid = e["pid"]
            name = self._names.get(pid, "reader")
            row = {
                "worker": name,
                "pid": pid,
                "waited_ms": round(e["waited_s"] * 1000, 1),
                "state": e["state"],
                "killed": e["killed"],
                "ts": time.time(),
            }
            with self._lock:
                self._recent_stalls.append(row)
            if e["killed"]:
                self._stall_killed[pid] = row
                what = "killed it (SIGKILL); the other workers' queries went on"
            else:
                what = (
                    "it is no worker process of this owner and is not killed: queries go "
                    "on, events wait until it leaves its read section"
                )
            log.warning(
                "%s pid=%d held a read section of the shared index for %d ms (process state "
                "%s, %s) while the ingest thread waited (--reader-stall-ms %d); %s",
                name,
                pid,
                int(e["waited_s"] * 1000),
                e["state"],
                STATES.get(e["state"], "unknown"),
                self.reader_stall_ms,
                what,
            )
        cur = lock.stalling()
        now = time.monotonic()
        if (
            cur is not None
            and cur["seconds"] >= STALL_NAG_SECS
            and now - self._stall_nagged >= STALL_NAG_SECS
        ):
            self._stall_nagged = now
            pid = cur["pid"]
            state = proc_state(pid)
            killed = " after SIGKILL" if pid in self._stall_killed else ""
            log.warning(
                "the ingest thread has waited %.0fs for %s pid=%d to leave its read "
                "section of the shared index (process state %s, %s%s); queries go on, "
                "events wait",
                cur["seconds"],
                self._names.get(pid, "reader"),
                pid,
                state,
                STATES.get(state, "unknown"),
                killed,
            )

    def info(self) -> dict[str, Any]:
        """``/workers`` ``processes.shared_lock`` (any thread; with a shared index)."""
        st = self.shared.stats()
        hist = self.shared.wait_histogram()
        stall_ms, _ = self.shared.lock.stall_policy()
        cur = self.shared.lock.stalling()
        with self._lock:
            recent = [dict(r) for r in self._recent_stalls]
        return {
            "reader_stall_ms": stall_ms,
            "write_sections": hist["count"],
            "writer_wait_seconds": round(hist["sum"], 6),
            "writer_waits": st["writer_waits"],
            "stalled_readers": st["stalled_readers"],
            "readers_killed": st["readers_killed"],
            "reclaimed_reader_slots": st["reclaimed_reader_slots"],
            "stalling": None
            if cur is None
            else {
                "worker": self._names.get(cur["pid"], "reader"),
                "pid": cur["pid"],
                "seconds": round(cur["seconds"], 3),
            },
            "recent_stalls": recent,
        }

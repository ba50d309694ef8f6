"""Warm restart on one node: snapshots in a directory (docs/operations.md, "Warm restart").

The directory is ``--snapshot-dir DIR``, by default ``$XDG_STATE_HOME/kvconductor/<port>``
(:func:`kvconductor.serve.settings.default_snapshot_dir`); ``--no-snapshots`` turns them off.
One server per directory: :meth:`SnapshotStore.prepare` takes an exclusive ``flock`` on
``DIR/lock`` (the file holds the holder's pid; the kernel releases the lock of a process
that dies, even by SIGKILL) and a second server is refused (:class:`DirectoryInUse`).

A snapshot is a dump (:mod:`kvconductor.state.dump`, format version 2: registrations, every
index, each source's sequence cursor, a snapshot counter in its header, an XXH3-64
checksum in its end record) written to ``DIR`` atomically: into a hidden temporary file,
flushed to disk, then renamed to ``snapshot-<counter>-<UTC time>.kvc`` and the directory
flushed. A reader therefore sees a whole snapshot or none; a crash mid-write leaves a
temporary file, removed at the next start (by the lock's holder only). The newest
snapshot is the one with the highest counter (1, 2, ... per directory, kept in the
header), never the latest clock time: a clock stepped back does not make an old snapshot
the newest. The two newest are kept.

:class:`Snapshotter` writes one every ``--snapshot-interval-secs`` (its own thread:
the ingest thread only takes the in-memory copy, tens of milliseconds per million
blocks; encoding and writing happen here), one about a second after a registration
changed (:meth:`Snapshotter.nudge`, coalesced: at most one per :data:`FOLLOW_SECS`;
only when the periodic snapshots are on), and a last one at shutdown.
:func:`warm_start` loads the newest snapshot that verifies and loads; one that does not
(corrupt, truncated, another format version, an index that breaks its invariants, or
any other failure while loading it) is refused with a log line naming the file, the
reason and what to do, and the next older one is tried; with none, the service starts
empty. A snapshot never stops a start. A registration the current flags refuse or that
cannot be opened now does not refuse its snapshot: it alone is skipped
(:mod:`kvconductor.state.restore`).
"""

from __future__ import annotations

import datetime
import fcntl
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from kvconductor.state import dump
from kvconductor.state.protocols import SnapshotStats

if TYPE_CHECKING:
    from kvconductor.state.conductor import Conductor

log = logging.getLogger("kvconductor.snapshot")

PREFIX = "snapshot-"
SUFFIX = ".kvc"
#: The lock file of a directory: ``flock``-ed by the server using it, holds its pid.
LOCK = "lock"
#: Digits of the counter in a snapshot's name (the header has the counter too).
COUNTER_DIGITS = 12
_COUNTER_IN_NAME = re.compile(r"snapshot-(\d+)-")
#: Seconds between tries while :meth:`SnapshotStore.prepare` waits for the lock.
LOCK_POLL = 0.1
#: Snapshots kept in the directory (the newest first); older ones are deleted.
KEEP = 2
#: Appended to the name of a snapshot refused at start (not loaded, not rotated).
REFUSED = ".refused"
DEFAULT_INTERVAL = 60
#: Seconds a registration change waits for its snapshot: the changes of a burst (a
#: Coordinator registering every engine) go into one.
FOLLOW_SECS = 1.0


class DirectoryInUse(Exception):
    """The snapshot directory is locked by another server (:attr:`pid`: its pid, None
    when its lock file does not say)."""

    def __init__(self, directory: str, pid: int | None) -> None:
        self.directory = directory
        self.pid = pid
        holder = f"kv-conductor pid {pid}" if pid is not None else "another kv-conductor"
        super().__init__(
            f"snapshot directory {directory} is in use by {holder} "
            f"(lock {os.path.join(directory, LOCK)})"
        )


class SnapshotStore:
    """The snapshot files of one directory. :meth:`prepare` before the first write (it
    takes the directory's lock), :meth:`release` after the last."""

    def __init__(self, directory: str, keep: int = KEEP) -> None:
        self.directory = directory
        self.keep = keep
        #: The counter of the last snapshot written or found in the directory (0: none).
        self.counter = 0
        self._lock_fd: int | None = None

    def prepare(self, wait: float = 0.0) -> None:
        """Create the directory (with its parents) if needed, take its lock (waiting up
        to ``wait`` seconds for another holder to let go), then remove temporaries of
        interrupted writes. :class:`DirectoryInUse` when another server holds the lock;
        ``OSError`` if the directory cannot be created, locked or written."""
        os.makedirs(self.directory, exist_ok=True)
        if self._lock_fd is None:
            self._lock(wait)
        try:
            for name in os.listdir(self.directory):
                if name.startswith("." + PREFIX) and name.endswith(".tmp"):
                    try:
                        os.unlink(os.path.join(self.directory, name))
                    except OSError:
                        pass
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise PermissionError(f"snapshot directory {self.directory} is not writable")
            self.counter = max([c for c, _ in self._ranked()], default=0)
        except BaseException:
            self.release()
            raise

    def _lock(self, wait: float) -> None:
        path = os.path.join(self.directory, LOCK)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + wait
        waiting = False
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    pid = _pid_in(fd)
                    if time.monotonic() >= deadline:
                        raise DirectoryInUse(self.directory, pid) from None
                    if not waiting:
                        waiting = True
                        log.info(
                            "snapshot directory %s is in use by pid %s: waiting up to %gs "
                            "for it to stop",
                            self.directory,
                            pid,
                            wait,
                        )
                    time.sleep(LOCK_POLL)
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        except BaseException:
            os.close(fd)
            raise
        self._lock_fd = fd

    def release(self) -> None:
        """Let go of the directory's lock (empties the lock file first)."""
        fd, self._lock_fd = self._lock_fd, None
        if fd is not None:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
            os.close(fd)

    def _ranked(self) -> list[tuple[int, str]]:
        """``(counter, name)`` of each snapshot file, newest first: by the counter in its
        header (else in its name; 0 for a snapshot of a kvconductor that kept none), then
        by name (the UTC time of counterless ones)."""
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return []
        ranked = [
            (_counter(os.path.join(self.directory, n)), n)
            for n in names
            if n.startswith(PREFIX) and n.endswith(SUFFIX)
        ]
        return sorted(ranked, reverse=True)

    def snapshots(self) -> list[str]:
        """The snapshot files, newest first (highest counter first)."""
        return [os.path.join(self.directory, n) for _, n in self._ranked()]

    def write(self, encode: Callable[[int], Iterable[bytes]]) -> tuple[str, int]:
        """Write one snapshot atomically: the chunks of ``encode(counter)`` (the dump with
        this snapshot's counter in its header); returns (path, bytes). Deletes the older
        ones beyond :attr:`keep`. ``OSError`` (the temporary file removed) on a failure."""
        self.counter += 1
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%S.%fZ")
        base = f"{PREFIX}{self.counter:0{COUNTER_DIGITS}d}-{stamp}"
        path = os.path.join(self.directory, base + SUFFIX)
        tmp = os.path.join(self.directory, f".{base}.tmp")
        size = 0
        try:
            with open(tmp, "wb") as f:
                for chunk in encode(self.counter):
                    f.write(chunk)
                    size += len(chunk)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
        _fsync_dir(self.directory)
        for old in self.snapshots()[self.keep :]:
            try:
                os.unlink(old)
            except OSError as ex:
                log.warning("cannot delete old snapshot %s: %s", old, ex)
        return path, size


def _pid_in(fd: int) -> int | None:
    """The pid a lock file holds (None: empty or not a pid)."""
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _counter(path: str) -> int:
    """A snapshot's counter: its header's, else its name's, else 0."""
    try:
        counter = dump.header(path).get("counter")
        if isinstance(counter, int) and counter >= 0:
            return counter
    except (OSError, ValueError):
        pass
    m = _COUNTER_IN_NAME.match(os.path.basename(path))
    return int(m.group(1)) if m else 0


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Snapshotter:
    """Writes a snapshot of ``conductor`` every ``interval`` seconds and
    :data:`FOLLOW_SECS` after a registration changed (:meth:`nudge`) from its own thread
    (``interval`` 0: only at :meth:`stop`). ``stop(final=True)`` writes the last one;
    call it after the HTTP server stopped and before the conductor stops."""

    def __init__(
        self,
        conductor: Conductor,
        store: SnapshotStore,
        interval: float,
        follow: float = FOLLOW_SECS,
    ) -> None:
        self.conductor = conductor
        self.store = store
        self.interval = float(interval)
        self.follow = float(follow)
        self.stats = SnapshotStats()
        self._wake = threading.Event()  # stop
        self._nudged = threading.Event()
        self._lock = threading.Lock()  # one write at a time
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="kvc-snapshot", daemon=True)
            self._thread.start()

    def nudge(self) -> None:
        """A registration changed (any thread): write a snapshot in :attr:`follow`
        seconds; the nudges meanwhile go into the same one."""
        self._nudged.set()

    def _run(self) -> None:
        due = time.monotonic() + self.interval
        while not self._wake.is_set():
            if self._nudged.wait(max(0.0, due - time.monotonic())):
                if self._wake.wait(self.follow):  # coalesce a burst of changes
                    return
                self._nudged.clear()
            elif self._wake.is_set():
                return
            self.write()
            due = time.monotonic() + self.interval

    def write(self) -> str | None:
        """Write a snapshot now; the path, or None (logged and counted) on a failure."""
        with self._lock:
            t0 = time.monotonic()
            try:
                snap = self.conductor.call(dump.snapshot, self.conductor, timeout=None)
                pause = time.monotonic() - t0
                path, size = self.store.write(lambda counter: dump.encode(snap, counter=counter))
            except Exception as ex:  # a full disk must not stop the service
                self.stats.failed += 1
                log.error("snapshot to %s failed: %s", self.store.directory, ex)
                return None
            took = time.monotonic() - t0
            s = self.stats
            s.written += 1
            s.last_time, s.last_bytes, s.last_seconds, s.last_pause = time.time(), size, took, pause
            pairs = sum(_pairs(ix) for ix in snap["indexes"])
            log.info(
                "snapshot written path=%s bytes=%d pairs=%d registrations=%d sources=%d "
                "in %.3fs (ingest paused %.3fs)",
                path,
                size,
                pairs,
                len(snap["registrations"]),
                len(snap["sources"]),
                took,
                pause,
            )
            return path

    def stop(self, final: bool = True) -> None:
        """Stop the periodic thread; with ``final``, write one last snapshot. Then let go
        of the directory's lock."""
        self._wake.set()
        self._nudged.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if final:
            self.write()
        self.store.release()


def _pairs(ix: dump.IndexSnapshot) -> int:
    """(worker, block) pairs of one index of a snapshot."""
    t = ix["tables"]
    return len(t["hbm_members"][0]) + len(t["cpu"][0]) + len(t["disk"][0])


def _refuse(path: str, why: BaseException | str) -> None:
    """One ERROR line; the file is renamed ``<name>.refused``: kept for a post-mortem, out
    of the rotation (a refused newest snapshot must not push the good one out of the two
    kept at the next write)."""
    try:
        os.replace(path, path + REFUSED)
        kept = f" (kept as {os.path.basename(path)}{REFUSED})"
    except OSError as ex:
        kept = f" (cannot rename it: {ex})"
    log.error("snapshot %s refused: %s%s", path, why, kept)


def _unexpected(ex: BaseException) -> str:
    """The reason of a failure no check named (a bug): its type, text and what to do."""
    return (
        f"{type(ex).__name__}: {ex} (an unexpected failure while loading it: the next "
        "older snapshot is tried, else the service starts empty and is filled again by "
        "the engines' registrations; please report it with the kept file)"
    )


def warm_start(conductor: Conductor, store: SnapshotStore) -> dict[str, object] | None:
    """Load the newest snapshot of ``store`` that verifies and loads into the started,
    empty ``conductor``; None when there is none. Never raises: each one refused (it
    does not verify, or its content does not load: an index that breaks its
    invariants, any other failure) is logged with one ERROR line, what it loaded is
    forgotten, and the next older one is tried. A registration the current flags refuse
    or that cannot be opened now is skipped, not its snapshot
    (:mod:`kvconductor.state.restore`). Its registrations reopen their subscriptions,
    which resume from the snapshot's cursors."""
    for path in store.snapshots():
        t0 = time.monotonic()
        try:
            dump.verify(dump.file_chunks(path))
        except (OSError, ValueError) as ex:
            _refuse(path, ex)
            continue
        except Exception as ex:
            _refuse(path, _unexpected(ex))
            continue
        try:
            loaded = conductor.call(dump.load_dump, conductor, dump.file_chunks(path), timeout=None)
        except Exception as ex:
            _refuse(path, ex if isinstance(ex, OSError | ValueError) else _unexpected(ex))
            try:
                conductor.call(reset, conductor, timeout=None)  # forget what it loaded
            except Exception:
                log.exception("forgetting the refused snapshot's state failed")
            continue
        took = time.monotonic() - t0
        log.info(
            "warm start from snapshot %s: registrations=%d indexes=%d sources=%d skipped=%d "
            "in %.3fs",
            path,
            loaded["registrations"] - loaded["skipped"],
            loaded["indexes"],
            loaded["sources"],
            loaded["skipped"],
            took,
        )
        return {"path": path, "seconds": took, **loaded}
    return None


def reset(conductor: Conductor) -> None:
    """Forget every subscription, registration and index (ingest thread): what a failed
    load left, or a replica's state before it loads a snapshot."""
    from kvconductor.state.registry import Registry

    for entry in list(conductor.registry.instances.values()):
        for dp in list(entry.endpoints):
            conductor.subs.unsubscribe(entry.instance_id, dp)
    conductor.registry = Registry(conductor.config.url_policy)
    for key in list(conductor.indexes):
        conductor.drop_index(key)
    conductor.lora_seeds = {}
    conductor.registrations_changed()

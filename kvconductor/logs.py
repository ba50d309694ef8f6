"""Log record helpers shared by the log formatters and ``GET /workers``.

:class:`RecentWarnings` keeps the last WARN and ERROR records of the ``kvconductor``
loggers in a bounded ring, for ``/workers.recent_warnings`` (docs/api.md, GET /workers)
and the live view ``kv-conductor top``.
"""

from __future__ import annotations

import collections
import logging
from datetime import datetime, timezone

__all__ = [
    "MAX_MESSAGE",
    "RECENT_WARNINGS",
    "RecentWarnings",
    "level_name",
    "process_role",
    "set_process_role",
    "utc",
]

#: Records kept by :class:`RecentWarnings` (the oldest is forgotten first).
RECENT_WARNINGS = 50
#: Characters of a message kept in the ring (a longer one is cut and ends with "...").
MAX_MESSAGE = 1000

_LEVEL_NAMES = {logging.WARNING: "WARN", logging.CRITICAL: "ERROR"}


_ROLE: str | None = None


def set_process_role(role: str | None) -> None:
    """Name this process in every log line: ``owner``, ``worker-3`` (``kv-conductor
    --workers N``); ``None`` (one process, the default): lines carry no process field."""
    global _ROLE
    _ROLE = role


def process_role() -> str | None:
    """The role set by :func:`set_process_role`, or ``None``."""
    return _ROLE


def utc(created: float) -> str:
    """RFC 3339 UTC with microseconds and a ``Z``: ``2026-11-30T18:10:00.123456Z``."""
    return datetime.fromtimestamp(created, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def level_name(levelno: int, levelname: str) -> str:
    """The level as the logs write it: ``DEBUG``, ``INFO``, ``WARN``, ``ERROR``."""
    return _LEVEL_NAMES.get(levelno, levelname)


class RecentWarnings(logging.Handler):
    """The last ``capacity`` WARN+ records as ``{"ts", "level", "message"}`` dicts.

    A :class:`logging.Handler` (its lock makes it thread-safe): attach it to a logger
    with :meth:`install`, read it with :meth:`snapshot` from any thread. Only records
    the logger lets through reach it (with ``--log-level error`` no WARN line does).
    """

    def __init__(self, capacity: int = RECENT_WARNINGS) -> None:
        super().__init__(logging.WARNING)
        self._ring: collections.deque[dict[str, str]] = collections.deque(maxlen=capacity)
        self._logger: logging.Logger | None = None

    def emit(self, record: logging.LogRecord) -> None:  # called under self.lock
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: the stream handler reports it
            message = str(record.msg)
        if len(message) > MAX_MESSAGE:
            message = message[: MAX_MESSAGE - 3] + "..."
        self._ring.append(
            {
                "ts": utc(record.created),
                "level": level_name(record.levelno, record.levelname),
                "message": message,
            }
        )

    def snapshot(self) -> list[dict[str, str]]:
        """The records kept, oldest first (copies)."""
        self.acquire()
        try:
            return [dict(r) for r in self._ring]
        finally:
            self.release()

    def install(self, name: str = "kvconductor") -> None:
        """Attach to the logger ``name`` (its children's records propagate to it)."""
        if self._logger is None:
            self._logger = logging.getLogger(name)
            self._logger.addHandler(self)

    def uninstall(self) -> None:
        """Detach from the logger :meth:`install` attached to."""
        if self._logger is not None:
            self._logger.removeHandler(self)
            self._logger = None

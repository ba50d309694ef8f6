"""Logging: the process's log setup (:func:`configure_logging`: text or JSON lines on
stderr), and the record helpers shared by the formatters and ``GET /workers``.

:class:`RecentWarnings` keeps the last WARN and ERROR records of the ``kvconductor``
loggers in a bounded ring, for ``/workers.recent_warnings`` (docs/api.md, GET /workers)
and the live view ``kv-conductor top``.

No value can forge a line: every message is written with its control characters
escaped (:func:`escape_controls`), whatever a request, an event or a peer put in it.
"""

from __future__ import annotations

import collections
import logging
import re
import sys
from datetime import datetime, timezone

import msgspec

__all__ = [
    "LOG_FORMATS",
    "MAX_MESSAGE",
    "RECENT_WARNINGS",
    "RecentWarnings",
    "configure_logging",
    "escape_controls",
    "level_name",
    "process_role",
    "set_process_role",
    "utc",
]

#: Records kept by :class:`RecentWarnings` (the oldest is forgotten first).
RECENT_WARNINGS = 50
#: Characters of a message kept in the ring (a longer one is cut and ends with "...").
MAX_MESSAGE = 1000

#: Values of ``--log-format``.
LOG_FORMATS = ("text", "json")
#: ``--log-level`` names and their levels.
LEVELS = {
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}

_LEVEL_NAMES = {logging.WARNING: "WARN", logging.CRITICAL: "ERROR"}

#: What a message may not carry raw: C0 (NUL, newline, ESC...), DEL, C1, and the Unicode
#: line and paragraph separators some viewers break lines on.
_CONTROLS = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def _escape(m: re.Match[str]) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def escape_controls(message: str) -> str:
    """``message`` with each control character written as ``\\xNN`` (``\\u2028``): a
    value holding a newline or an ESC sequence stays on its one line, as text."""
    if message.isprintable() or _CONTROLS.search(message) is None:
        return message  # isprintable(): no C0, DEL, C1, U+2028/U+2029, in C
    return _CONTROLS.sub(_escape, message)


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
        message = escape_controls(message)
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


class _Formatter(logging.Formatter):
    """``<RFC 3339 UTC time> <LEVEL> <message>`` (the reference hides target names).

    With ``--workers N > 1`` the process comes after the level:
    ``<time> <LEVEL> [worker-3 pid=1234] <message>`` (:func:`set_process_role`). The
    message is one line (:func:`escape_controls`); only a traceback follows it.
    """

    def format(self, record: logging.LogRecord) -> str:
        level = level_name(record.levelno, record.levelname)
        role = process_role()
        message = escape_controls(record.getMessage())
        if role is None:
            line = f"{utc(record.created)} {level:>5} {message}"
        else:
            line = f"{utc(record.created)} {level:>5} [{role} pid={record.process}] {message}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class _JsonFormatter(logging.Formatter):
    """One JSON object per line with the text line's fields: ``ts`` (RFC 3339 UTC),
    ``level``, ``message``, and ``exception`` (the traceback) when there is one; with
    ``--workers N > 1`` also ``process`` (``owner``, ``worker-3``) and ``pid``."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict = {
            "ts": utc(record.created),
            "level": level_name(record.levelno, record.levelname),
            "message": escape_controls(record.getMessage()),
        }
        role = process_role()
        if role is not None:
            doc["process"] = role
            doc["pid"] = record.process
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return _JSON_ENCODER.encode(doc).decode()


_JSON_ENCODER = msgspec.json.Encoder()


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Log to stderr as text or JSON lines; uvicorn's own loggers only show warnings
    unless debugging."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"unknown log format {fmt!r}: one of {', '.join(LOG_FORMATS)}")
    lvl = LEVELS.get(level, logging.INFO)
    root = logging.getLogger()
    for h in list(root.handlers):
        if getattr(h, "_kvconductor", False):
            root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonFormatter() if fmt == "json" else _Formatter())
    handler._kvconductor = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(lvl)
    quiet = logging.DEBUG if lvl <= logging.DEBUG else logging.WARNING
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).setLevel(quiet)

"""The fast text of ``GET /metrics``: the per-source column readers and the families
written as text (docs/api.md, GET /metrics).

A scrape of thousands of sources formats one line per (source, medium) and family.
:class:`SourceLines` reads the columns of a
:class:`~kvconductor.ingest.sourcemetrics.SourceSnapshot` (labels, flags, ages) into
``name{labels} value`` lines, keeping what did not change since the last scrape, a
:data:`CHUNK` of lines at a time with the :class:`Pacer`'s pauses between two (so the
event loop answers queries during a large scrape); a :class:`RenderedFamily` carries
those lines and :func:`exposition` writes them as they are, beside what
``generate_latest`` writes for the other families. The families themselves are in
:mod:`kvconductor.http.metrics`.

**Threading:** a scrape may run on any thread; a :class:`SourceLines` keeps its caches
in one attribute each, read once per call, so two concurrent scrapes at worst both
format.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

__all__ = [
    "CHUNK",
    "PAUSE",
    "SLICE",
    "Pacer",
    "RenderedFamily",
    "SourceLines",
    "exposition",
    "help_text",
]


class RenderedFamily(Metric):
    """A family whose samples are already text (one line per sample, in the format
    ``generate_latest`` writes): :func:`exposition` writes its header and
    :attr:`text` as they are. Its ``samples`` stay empty: only :func:`exposition` renders
    it (``generate_latest`` would write its header alone).
    """

    def __init__(self, name: str, documentation: str, typ: str, text: list[bytes]) -> None:
        super().__init__(name, documentation, typ)
        #: The lines, UTF-8, in pieces to be joined.
        self.text = text

    def header(self) -> bytes:
        """``# HELP`` and ``# TYPE`` as ``generate_latest`` writes them (a counter's
        name with ``_total``)."""
        name = self.name + "_total" if self.type == "counter" else self.name
        return (
            f"# HELP {name} {help_text(self.documentation)}\n# TYPE {name} {self.type}\n".encode()
        )


def help_text(doc: str) -> str:
    """A ``# HELP`` text as ``generate_latest`` escapes it."""
    return doc.replace("\\", r"\\").replace("\n", r"\n")


#: Lines a scrape formats between two chances to pause (:class:`Pacer`).
CHUNK = 1024
#: Seconds of formatting after which a scrape pauses at its next chance.
SLICE = 0.002
#: Seconds a pause sleeps.
PAUSE = 0.0001


class Pacer:
    """The pauses of one scrape: called between two slices of work, it sleeps
    :data:`PAUSE` once :data:`SLICE` seconds have passed since the last pause (or the
    start), so that other threads take the GIL: the event loop answers queries between
    two slices of a large scrape instead of waiting for its whole formatting (the scrape
    runs in a worker thread, never on the event loop). A sleep, not ``sleep(0)``:
    CPython hands the GIL to a waiting thread only when the holder blocks or after the
    switch interval (5 ms)."""

    __slots__ = ("last",)

    def __init__(self) -> None:
        self.last = time.perf_counter()

    def __call__(self) -> None:
        if time.perf_counter() - self.last >= SLICE:
            time.sleep(PAUSE)
            self.last = time.perf_counter()


#: A 0/1 gauge's values, with the line's newline.
_FLAG = (b"0.0\n", b"1.0\n")


class SourceLines:
    """The lines of one per-source family: ``name{labels} value``, one per (source,
    medium) of a :class:`~kvconductor.ingest.sourcemetrics.SourceSnapshot`, as UTF-8.

    The ``name{labels} `` prefixes are kept while the label sets stay the same (the same
    sources in the same order: a list comparison that meets the same string objects), so
    a scrape only formats the values and joins. A 0/1 family keeps its whole text while
    its label sets and flags stay the same (:meth:`flags`).
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._cache: tuple[list[str], list[bytes]] = ([], [])
        #: :meth:`flags`' last (label sets, flags, text).
        self._text: tuple[list[str], list[bool], list[bytes]] = ([], [], [])

    def _prefixes(self, labels: list[str]) -> list[bytes]:
        cache = self._cache  # one read: a concurrent scrape may replace it
        if cache[0] != labels:
            cache = (labels, [f"{self.name}{ls} ".encode() for ls in labels])
            self._cache = cache
        return cache[1]

    def flags(self, labels: list[str], flags: list[bool], pause: Callable[[], None]) -> list[bytes]:
        """The lines of a 0/1 gauge: ``1.0`` where ``flags`` is true, :data:`CHUNK` lines
        a piece, ``pause()`` between two pieces. The text of the last call is reused
        while ``labels`` and ``flags`` compare equal (the same label set objects, the
        same booleans: C comparisons): a source's state rarely changes between scrapes."""
        kept = self._text  # one read: a concurrent scrape may replace it
        if kept[1] == flags and kept[0] == labels:
            return kept[2]
        prefixes = self._prefixes(labels)
        out = []
        for i in range(0, len(labels), CHUNK):
            if i:
                pause()
            j = min(i + CHUNK, len(labels))
            # PERF: interleaved by slice assignment and joined once: no string is built
            # per sample.
            parts: list[bytes] = [b""] * (2 * (j - i))
            parts[::2] = prefixes[i:j]
            parts[1::2] = map(_FLAG.__getitem__, flags[i:j])
            out.append(b"".join(parts))
        self._text = (labels, flags, out)
        return out

    def ages(
        self, labels: list[str], now: float, last: list[float], pause: Callable[[], None]
    ) -> list[bytes]:
        """The lines of the ages ``max(0, now - t)`` of the wall-clock times ``last``,
        :data:`CHUNK` values formatted at a time, ``pause()`` between two chunks. The
        pieces are left unjoined (:func:`exposition` joins everything once)."""
        prefixes = self._prefixes(labels)
        parts: list[bytes] = [b"\n"] * (3 * len(labels))
        parts[::3] = prefixes
        for i in range(0, len(labels), CHUNK):
            if i:
                pause()
            j = min(i + CHUNK, len(labels))
            parts[3 * i + 1 : 3 * j : 3] = _ages(now, last[i:j])
        return parts


def _ages_repr(ages: list[float]) -> list[bytes]:
    """``floatToGoString(max(0, a))`` of each age, UTF-8."""
    return [floatToGoString(max(0.0, a)).encode() for a in ages]


#: The ages msgspec writes as ``floatToGoString`` does: ``[_LOW, _HIGH)``.
_LOW, _HIGH = 1e-4, 1e6


def _ages_msgspec(ages: list[float]) -> list[bytes]:
    """The same as :func:`_ages_repr`, in C: msgspec's JSON float (Ryu, the shortest
    digits that read back as the same float, the closest of them to its value: what
    ``repr`` writes) for every age of ``[1e-4, 1e6)``, where ``repr`` and msgspec write
    the same fixed notation and ``floatToGoString`` writes ``repr``; the others (exponent
    notation, negative ages clamped to 0, NaN) one at a time."""
    body = msgspec.json.encode(ages)
    out = body[1:-1].split(b",")
    if min(ages) < _LOW or max(ages) >= _HIGH or b"n" in body:  # b"null": NaN or inf
        # (rare: idle for 11 days, a clock step, a batch within the last 0.1 ms; a
        # comparison per age in Python is faster here than compress/map with a bound
        # float method)
        for k, a in enumerate(ages):
            if not 1e-4 <= a < 1e6:  # _LOW, _HIGH (literals: faster)
                # max(0.0, a): 0.0 for a <= 0 and NaN
                out[k] = floatToGoString(a).encode() if a > 0.0 else b"0.0"
    return out


def _msgspec_writes_repr() -> bool:
    """Whether the installed msgspec writes these floats as ``repr`` does (checked once,
    at import; otherwise every age takes :func:`_ages_repr`)."""
    probe = [1e-4, 0.00012345678901234, 0.1, 0.3, 2 / 3, 1.0, 100.0, 123456.789, 999999.9999999999]
    probe.append(1_700_000_123.456789 - 1_700_000_000.0)
    return msgspec.json.encode(probe)[1:-1].split(b",") == [repr(a).encode() for a in probe]


_FAST_AGES = _msgspec_writes_repr()


def _ages(now: float, last: list[float]) -> list[bytes]:
    """``floatToGoString(max(0, now - t))`` per wall-clock time ``t``, UTF-8."""
    if not last:
        return []
    ages = [now - t for t in last]
    # PERF: repr of a float with 17 significant digits (an age) takes Python's exact
    # big-number path, about 1 µs; msgspec's Ryu writes the same digits in ~0.1 µs.
    return _ages_msgspec(ages) if _FAST_AGES else _ages_repr(ages)


def exposition(registry: CollectorRegistry) -> bytes:
    """``generate_latest(registry)``, with the :class:`RenderedFamily` texts written as
    they are (a registry holding one renders through here only)."""
    parts: list[bytes] = []
    pending: list[Metric] = []
    for fam in registry.collect():
        if isinstance(fam, RenderedFamily):
            if pending:
                parts.append(generate_latest(_Families(pending)))
                pending = []
            parts.append(fam.header())
            parts += fam.text
        else:
            pending.append(fam)
    if pending:
        parts.append(generate_latest(_Families(pending)))
    # PERF: UTF-8 pieces joined once (no str of the whole text, no encoding of it)
    return b"".join(parts)


class _Families(Collector):
    """Families already collected, for ``generate_latest``."""

    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families

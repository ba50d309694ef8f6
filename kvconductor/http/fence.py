"""The uvicorn (and httptools) releases the protocol-level query path is tested on.

:mod:`kvconductor.http.direct` and :mod:`kvconductor.http.limits` subclass uvicorn's
``HttpToolsProtocol`` and rely on its instance attributes, parser callbacks, the bytes
of its ``STATUS_LINE`` (:mod:`kvconductor.http.framing` writes the same) and how its
request cycle is read (``tests/test_uvicorn_fence.py`` names every one and fails, with
the name, when one moves). That is only known to hold for the releases the HTTP tests
run against: :data:`UVICORN_RANGE` and :data:`HTTPTOOLS_RANGE`, declared the same in
``pyproject.toml`` (a test ties the two) and run at both ends by CI (``.ci/run``).

``--query-path protocol`` (the default) answers ``/query`` and ``/query_by_hash`` in the
protocol (:mod:`kvconductor.http.direct`); ``--query-path asgi`` answers them through the
ASGI app (:class:`~kvconductor.http.front.FrontDoor`), the same statuses, headers and
bodies. When the running uvicorn or httptools is outside its tested range,
:func:`query_path` logs one WARN and returns ``asgi``: the limits still apply (they only
use what uvicorn's own protocol documents for subclasses), the direct path does not run.
"""

from __future__ import annotations

import functools
import logging
import re
from importlib import metadata

log = logging.getLogger("kvconductor")

#: The query paths of ``--query-path``; the first is the default.
QUERY_PATHS = ("protocol", "asgi")
#: uvicorn releases the HTTP tests run on: at least the first, below the second.
UVICORN_RANGE = ("0.30.6", "0.56")
#: httptools releases the HTTP tests run on: at least the first, below the second.
HTTPTOOLS_RANGE = ("0.9.0", "0.10")


def version_key(version: str) -> tuple[int, ...]:
    """``"0.30.6"`` -> ``(0, 30, 6)``; stops at the first part that is not a number
    (``"0.36.0rc1"`` -> ``(0, 36, 0)``, ``"0.27.0.post1"`` -> ``(0, 27, 0)``)."""
    key = []
    for part in version.split("."):
        m = re.match(r"\d+", part)
        if m is None:
            break
        key.append(int(m.group()))
        if m.end() != len(part):
            break
    return tuple(key)


def in_range(version: str, bounds: tuple[str, str]) -> bool:
    """True when ``bounds[0] <= version < bounds[1]``."""
    key = version_key(version)
    return version_key(bounds[0]) <= key < version_key(bounds[1])


def installed_version(dist: str) -> str | None:
    """The installed release of the distribution ``dist``, ``None`` when none is."""
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def outside_tested_range() -> str | None:
    """Why the running uvicorn or httptools is outside its tested range, or ``None``."""
    import uvicorn

    problems = []
    version = getattr(uvicorn, "__version__", None) or installed_version("uvicorn") or "?"
    if not in_range(version, UVICORN_RANGE):
        problems.append(f"uvicorn {version} (tested: >={UVICORN_RANGE[0]},<{UVICORN_RANGE[1]})")
    httptools = installed_version("httptools")
    if httptools is not None and not in_range(httptools, HTTPTOOLS_RANGE):
        problems.append(
            f"httptools {httptools} (tested: >={HTTPTOOLS_RANGE[0]},<{HTTPTOOLS_RANGE[1]})"
        )
    return "; ".join(problems) or None


@functools.cache
def query_path(requested: str) -> str:
    """The query path a server takes for ``--query-path requested``: ``protocol`` falls
    back to ``asgi`` (one WARN per process) when uvicorn or httptools is outside its
    tested range."""
    if requested != "protocol":
        return requested
    why = outside_tested_range()
    if why is None:
        return requested
    log.warning(
        "--query-path protocol: %s is outside the tested range; answering the query "
        "routes through ASGI instead (query_path=asgi)",
        why,
    )
    return "asgi"

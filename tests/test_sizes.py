"""Rooms by job: no ``.py`` module of ``kvconductor/`` over 700 lines and no compiled
source (``.pyx``, ``.pxi``, ``.pxd``) over 1,000 (CONTRIBUTING.md, "Layout"; issue 37).

A module past its limit is split by job (a cohesive responsibility with a name, as
``_index.pyx`` is into its ``_index_*.pxi``), not by line count. The files still over
are listed in :data:`ALLOWLIST` with their line count at the time, a ceiling: the list
may only shrink. A listed file that grows past its ceiling fails, and so does one that
is now within the limit (trim its line here when it is split).
"""

from __future__ import annotations

import pathlib

import kvconductor

PKG = pathlib.Path(kvconductor.__file__).parent

#: Lines a ``.py`` module may have.
PY_LIMIT = 700
#: Lines a compiled source (``.pyx``, ``.pxi``, ``.pxd``) may have.
COMPILED_LIMIT = 1000
COMPILED_SUFFIXES = (".pyx", ".pxi", ".pxd")

#: Files still over their limit (path under ``kvconductor/`` -> lines today, a ceiling).
#: Only ever lower a number or remove a line.
ALLOWLIST: dict[str, int] = {}


def _limit(path: pathlib.Path) -> int:
    return COMPILED_LIMIT if path.suffix in COMPILED_SUFFIXES else PY_LIMIT


def _sources() -> dict[str, pathlib.Path]:
    found = [*PKG.rglob("*.py"), *(p for s in COMPILED_SUFFIXES for p in PKG.rglob("*" + s))]
    return {p.relative_to(PKG).as_posix(): p for p in sorted(found)}


SOURCES = _sources()


def lines(path: pathlib.Path) -> int:
    """Lines of ``path`` as ``wc -l`` counts them (a last line without a newline too)."""
    return len(path.read_text().splitlines())


def test_the_walk_sees_the_package():
    assert len(SOURCES) > 100
    assert {"http/api.py", "_tree.pyx", "_index_query.pxi", "_maps.pxd"} <= set(SOURCES)


def test_no_source_over_its_limit():
    over = []
    for rel, path in SOURCES.items():
        n = lines(path)
        ceiling = ALLOWLIST.get(rel, _limit(path))
        if n > ceiling:
            why = "its allowlisted ceiling" if rel in ALLOWLIST else "the limit"
            over.append(f"kvconductor/{rel}: {n} lines, over {why} of {ceiling}")
    assert not over, (
        "split these by job (CONTRIBUTING.md, Layout), do not raise the numbers:\n"
        + "\n".join(over)
    )


def test_the_allowlist_only_shrinks():
    """Every allowlisted file still exists and is still over its limit (else its line goes)."""
    stale = []
    for rel, ceiling in sorted(ALLOWLIST.items()):
        path = PKG / rel
        if not path.is_file():
            stale.append(f"kvconductor/{rel} is gone: remove it from ALLOWLIST")
            continue
        limit = _limit(path)
        if ceiling <= limit:
            stale.append(f"kvconductor/{rel}: a ceiling at or under the limit")
        elif lines(path) <= limit:
            stale.append(
                f"kvconductor/{rel} has {lines(path)} lines, within the limit of {limit}: "
                "remove it from ALLOWLIST so that it stays there"
            )
    assert not stale, "\n".join(stale)


def test_the_check_counts_like_wc(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("a\nb\n")
    assert lines(f) == 2
    f.write_text("a\nb")
    assert lines(f) == 2

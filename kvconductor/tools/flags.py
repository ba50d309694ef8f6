"""A number flag's value, read and checked: what every command line of the package
(``kv-conductor``'s own flags, ``kv-conductor top``'s) passes argparse as ``type=``.
Here, the floor below both, so that ``serve/`` and ``tools/`` share one reader."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

N = TypeVar("N", int, float)


def decimal(value: str) -> int:
    """An integer written in base 10 (no ``0x``, no ``_``)."""
    return int(value, 10)


def number(
    value: str,
    read: Callable[[str], N],
    what: str,
    required: str,
    ok: Callable[[N], bool],
    rule: str,
) -> N:
    """``read(value)`` when it reads and ``ok`` holds for it; else an
    ``argparse.ArgumentTypeError``: ``invalid {what} {value!r}: {required}`` when it does
    not read, ``invalid {what} {shown}: {rule}`` when ``ok`` fails (``shown``: the integer
    read, or the text given for a float)."""
    try:
        n = read(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid {what} {value!r}: {required}") from None
    if not ok(n):
        shown = n if isinstance(n, int) else repr(value)
        raise argparse.ArgumentTypeError(f"invalid {what} {shown}: {rule}")
    return n

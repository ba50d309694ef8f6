"""How many Hypothesis examples a long property test runs: its own count at the default
``KVC_DIFFERENTIAL_EXAMPLES`` (200, run locally), scaled down with it where CI bounds
the suite (``.ci/run``: 60 in the suite, 20 under the sanitizers)."""

from __future__ import annotations

import os

#: the examples of a differential test (tests/test_differential.py's count)
DIFFERENTIAL = int(os.environ.get("KVC_DIFFERENTIAL_EXAMPLES", "200"))


def scaled(n: int, least: int = 10) -> int:
    """``n`` examples at the default, in proportion below it, never under ``least``."""
    return max(least, n * DIFFERENTIAL // 200)

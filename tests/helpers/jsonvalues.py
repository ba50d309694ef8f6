"""Hypothesis strategies of the JSON values clients and engines send, for the fuzz tests
of what kvconductor reads from them (tests/test_dynamo_input.py: request bodies;
tests/test_engine_url.py: an engine's ``/kv_event_sources``)."""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st


def json_values(
    strings: Sequence[str], *, nan: bool, max_size: int, max_leaves: int
) -> st.SearchStrategy:
    """Any JSON value: ints well past i64 and u64 both ways, floats (``NaN`` and the
    infinities when ``nan``: Python's ``json`` writes them as JSON never has them), text,
    ``strings`` (the values that mean something to the reader), and lists and objects of
    them up to ``max_size`` items and ``max_leaves`` scalars."""
    scalars = (
        st.none()
        | st.booleans()
        | st.integers(min_value=-(2**70), max_value=2**70)
        | st.floats(allow_nan=nan, allow_infinity=nan)
        | st.text(max_size=24)
        | st.sampled_from(list(strings))
    )
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=max_size)
            | st.dictionaries(st.text(max_size=8), inner, max_size=4)
        ),
        max_leaves=max_leaves,
    )

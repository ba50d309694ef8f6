"""kvconductor.tools.flags: a number flag's value read and checked (every number type of
``kv-conductor`` and ``kv-conductor top``)."""

from __future__ import annotations

import argparse

import pytest

from kvconductor.tools.flags import decimal, number


def _port(value: str) -> int:
    return number(value, decimal, "port", "an integer is required", lambda n: n < 10, "small")


def _secs(value: str) -> float:
    return number(value, float, "value", "seconds", lambda s: s > 0, "must be > 0")


def test_a_good_value_is_read():
    assert _port("7") == 7 and _secs("0.5") == 0.5


@pytest.mark.parametrize(
    ("parse", "value", "message"),
    [
        (_port, "x", "invalid port 'x': an integer is required"),
        (_port, "0x7", "invalid port '0x7': an integer is required"),  # base 10 only
        (_port, "012", "invalid port 12: small"),  # an integer: the number read
        (_secs, "nope", "invalid value 'nope': seconds"),
        (_secs, "-0.50", "invalid value '-0.50': must be > 0"),  # a float: the text given
        (_secs, "nan", "invalid value 'nan': must be > 0"),
    ],
)
def test_a_bad_value_is_one_line(parse, value, message):
    with pytest.raises(argparse.ArgumentTypeError) as ex:
        parse(value)
    assert str(ex.value) == message

"""The test suite as a package: test modules import their shared helpers from
``tests.helpers`` and never from each other (``tests/test_layers.py`` checks it)."""

import pytest

# Before any helper is imported: pytest rewrites their asserts as it does the test
# modules' (a failing assert in a helper shows the values it compared).
pytest.register_assert_rewrite("tests.helpers")

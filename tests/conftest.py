"""Loads the suite's shared plugin (fixtures and process set-up live in tests/support/)."""

import pytest

# The shared helpers assert (tests.support.laws' chi-square checks): rewritten as test modules are, so that a
# failure shows its values.
pytest.register_assert_rewrite("tests.support")

pytest_plugins = ["tests.support.fixtures"]

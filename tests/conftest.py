"""Loads the suite's shared plugin (fixtures and process set-up live in tests/support/)."""

pytest_plugins = ["tests.support.fixtures"]

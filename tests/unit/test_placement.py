"""Torch threads per service of the local stack, from the machine's cores."""

import pytest

from specmesh import placement


def test_verify_takes_every_core_and_the_draft_half(monkeypatch):
    monkeypatch.setattr(placement, "cores", lambda: 8)
    assert placement.service_threads("verify") == 8
    assert placement.service_threads("draft") == 4
    monkeypatch.setattr(placement, "cores", lambda: 1)
    assert placement.service_threads("draft") == 1  # never 0


def test_an_explicit_count_wins_and_unknown_roles_are_refused():
    assert placement.service_threads("draft", 3) == 3
    with pytest.raises(ValueError, match="role"):
        placement.service_threads("gateway")

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


def test_drafting_ahead_only_where_it_has_cores_of_its_own(monkeypatch):
    monkeypatch.setattr(placement, "cores", lambda: 2)
    assert not placement.pipeline_pays(2, 1)  # verify on both cores: drafting ahead would steal them
    assert placement.pipeline_pays(1, 1)
    monkeypatch.setattr(placement, "cores", lambda: 16)
    assert placement.pipeline_pays(8, 8)

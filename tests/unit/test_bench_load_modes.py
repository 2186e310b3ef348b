"""bench.load sends each mode's requests in its own cache scope (cache_salt), so neither mode finds a prompt
the other one prefilled: the A/B compares the same cache history on both sides. Its A/A control sends target-only
on both sides."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from bench.load import MODE_SALT, MODES, WARM_SALT, run_level


class _Stream:
    def __init__(self) -> None:
        self._chunks = [
            SimpleNamespace(choices=[SimpleNamespace(text="a")], usage=None, model_extra={}),
            SimpleNamespace(choices=[], usage=SimpleNamespace(completion_tokens=1), model_extra={}),
        ]

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self._chunks:
            raise StopAsyncIteration
        return self._chunks.pop(0)


class _Client:
    """What run_level needs of openai.AsyncOpenAI, recording each request's extra_body."""

    def __init__(self) -> None:
        self.extra: list[dict] = []
        self.completions = SimpleNamespace(create=self._create)

    async def _create(self, **kwargs):
        self.extra.append(kwargs["extra_body"])
        return _Stream()


def test_each_mode_has_its_own_cache_salt_and_every_request_carries_it():
    assert set(MODE_SALT) == set(MODES) and len(set(MODE_SALT.values())) == len(MODES)
    for mode in MODES:
        client = _Client()
        records, _ = asyncio.run(run_level(client, [[1, 2, 3]], 3, 2, 1, 0.0, 0, 10.0, cache_salt=MODE_SALT[mode]))
        assert [r["error"] for r in records] == [None] * 3
        assert [e.get("cache_salt") for e in client.extra] == [MODE_SALT[mode]] * 3


def test_the_warm_ups_never_share_a_scope_with_what_they_warm_up():
    """A greedy warm-up in the measured scope generated the first tokens of the outputs the level then measured,
    and the suffix trees (scoped by cache_salt) proposed them back: each mode warms up in a scope of its own."""
    assert set(WARM_SALT) == set(MODES) and len(set(WARM_SALT.values())) == len(MODES)
    assert set(WARM_SALT.values()).isdisjoint(MODE_SALT.values())
    for mode in MODES:
        client = _Client()
        asyncio.run(run_level(client, [[1, 2]], 2, 2, 1, 0.0, None, 10.0, cache_salt=WARM_SALT[mode]))
        assert {e["cache_salt"] for e in client.extra} == {WARM_SALT[mode]}


def test_no_salt_sends_none():
    client = _Client()
    asyncio.run(run_level(client, [[1]], 1, 1, 1, 0.0, None, 10.0))
    assert client.extra == [{"ignore_eos": True}]


def test_the_aa_control_sends_target_only_on_both_sides_without_probing(monkeypatch):
    """`--aa-control`: the speculative side's K is 0, asked of nobody, so each level compares target-only with
    itself; without it the side keeps the K that a probe showed drafting, and one that does not draft is an error."""
    import bench.load as load

    asked: list = []

    async def probe(client, prompt, k, timeout):
        asked.append(k)
        return {"num_speculative_tokens": k, "drafted": 0 if k is None else 3}

    monkeypatch.setattr(load, "probe", probe)
    assert asyncio.run(load.speculative_k(None, [1], None, 1.0, aa_control=True)) == (0, None) and asked == []
    k, seen = asyncio.run(load.speculative_k(None, [1], None, 1.0))
    assert k == load.FALLBACK_K and seen["drafted"] == 3 and asked == [None, load.FALLBACK_K]

    async def never(client, prompt, k, timeout):
        return {"num_speculative_tokens": k, "drafted": 0}

    monkeypatch.setattr(load, "probe", never)
    with pytest.raises(RuntimeError, match="do not draft"):
        asyncio.run(load.speculative_k(None, [1], 4, 1.0))

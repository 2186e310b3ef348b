"""bench.load sends each mode's requests in its own cache scope (cache_salt), so neither mode finds a prompt
the other one prefilled: the A/B compares the same cache history on both sides."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from bench.load import MODE_SALT, MODES, run_level


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


def test_no_salt_sends_none():
    client = _Client()
    asyncio.run(run_level(client, [[1]], 1, 1, 1, 0.0, None, 10.0))
    assert client.extra == [{"ignore_eos": True}]

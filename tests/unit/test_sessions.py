"""The verify service's SessionStore: KV budget and LRU eviction, TTL expiry, release, peek, accounting.

Time is a fake clock handed to the store, so expiry is tested by moving the clock, never by sleeping.
Sessions hold real KV caches of a tiny model: the byte accounting is checked against the cache tensors
(ModelRunner: bytes per cached token) and against the slot pool (BatchedRunner: whole slots).
"""

import pytest

from specmesh.errors import FailedPrecondition, NotFound, ResourceExhausted
from specmesh.runtime.base import kv_bytes_per_token
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from tests.support.models import tiny_model
from verify_service.sessions import SessionStore

PROMPT = list(range(1, 11))  # 10 tokens: prefill caches 9 (the last one is fed by the next forward)
CACHED = len(PROMPT) - 1


class FakeClock:
    def __init__(self, start: float = 1000.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(tiny_model("llama", vocab=64, hidden=32, seed=3))


@pytest.fixture
def clock():
    return FakeClock()


def bpt(runner) -> int:
    return kv_bytes_per_token(runner.config, next(runner.model.parameters()).dtype)


def make_store(runner, clock, budget_tokens: int = 1000, ttl: float = 60.0) -> SessionStore:
    return SessionStore(runner, budget_tokens * bpt(runner), ttl, bpt(runner), clock=clock)


def open_prefilled(store: SessionStore, session_id: str, prompt=PROMPT):
    """What the engine does for a turn: open, then prefill (only a prefilled session holds KV bytes)."""
    session = store.open(session_id, prompt)
    store.runner.prefill(session.seq)
    return session


def cache_bytes(session) -> int:
    return sum(t.numel() * t.element_size() for layer in session.seq.cache.layers for t in (layer.keys, layer.values))


def test_kv_bytes_counts_cached_tokens_and_matches_the_cache_tensors(runner, clock):
    store = make_store(runner, clock)
    a = store.open("a", PROMPT)
    assert store.kv_bytes() == 0  # opened, not yet prefilled: nothing cached
    runner.prefill(a.seq)
    b = open_prefilled(store, "b", [*PROMPT, 11, 12])
    assert store.kv_bytes() == (CACHED + CACHED + 2) * store.account.bytes_per_token
    # the per-token figure is what the cache really holds, keys and values of every layer
    assert store.kv_bytes() == cache_bytes(a) + cache_bytes(b)
    store.release("a")
    assert store.kv_bytes() == cache_bytes(b)


def test_lru_eviction_under_the_budget_evicts_the_least_recently_used_idle_session_first(runner, clock):
    store = make_store(runner, clock, budget_tokens=3 * CACHED + 3)
    for sid in "abc":
        open_prefilled(store, sid)
        clock.advance(1)
    store.get("a")  # a is now the most recently used: b is the oldest
    open_prefilled(store, "d")  # 27 cached + 10 new > 30: one idle session has to go
    assert store.peek("b") is None
    assert [sid for sid in "acd" if store.peek(sid) is not None] == list("acd")
    assert store.evicted == 1
    assert len(store) == 3
    # next in line is c (a was touched after it, d is new)
    open_prefilled(store, "e")
    assert store.peek("c") is None and store.peek("a") is not None
    assert store.evicted == 2


def test_eviction_stops_as_soon_as_the_new_tokens_fit(runner, clock):
    store = make_store(runner, clock, budget_tokens=4 * CACHED)
    for sid in "abc":
        open_prefilled(store, sid)
    open_prefilled(store, "d", PROMPT + list(range(11, 19)))  # 18 tokens: 27 + 18 > 36, 18 + 18 fits
    assert store.peek("a") is None
    assert store.peek("b") is not None and store.peek("c") is not None
    assert store.evicted == 1


def test_attached_sessions_are_never_evicted(runner, clock):
    store = make_store(runner, clock, budget_tokens=3 * CACHED + 3)
    a, b = open_prefilled(store, "a"), open_prefilled(store, "b")
    a.attached = b.attached = True
    open_prefilled(store, "c")
    open_prefilled(store, "d")  # a and b are older, but attached: c goes
    assert store.peek("c") is None
    assert store.peek("a") is a and store.peek("b") is b
    assert store.attached == 2
    assert store.evicted == 1


def test_a_budget_that_cannot_fit_the_session_raises_resource_exhausted(runner, clock):
    store = make_store(runner, clock, budget_tokens=2 * CACHED + 3)
    a, b = open_prefilled(store, "a"), open_prefilled(store, "b")
    a.attached = b.attached = True
    with pytest.raises(ResourceExhausted, match="KV cache budget full") as err:
        store.open("c", PROMPT)
    assert err.value.code == "RESOURCE_EXHAUSTED" and err.value.retryable
    assert store.peek("c") is None and len(store) == 2  # nothing half-created
    assert store.peek("a") is a and store.peek("b") is b

    # a prompt larger than the whole budget fails even with an empty store
    empty = make_store(runner, clock, budget_tokens=5)
    with pytest.raises(ResourceExhausted):
        empty.open("big", PROMPT)
    assert len(empty) == 0


def test_reopening_a_session_never_evicts_the_session_itself(runner, clock):
    store = make_store(runner, clock, budget_tokens=3 * CACHED + 3)
    a = open_prefilled(store, "a")  # the oldest
    open_prefilled(store, "b")
    open_prefilled(store, "c")
    longer = PROMPT + list(range(11, 19))
    again = store.open("a", longer)  # a longer turn needs room: the others make it, oldest first
    assert again is a and a.seq.token_ids == longer
    assert store.peek("b") is None
    assert store.evicted >= 1


def test_ttl_expiry_follows_the_clock(runner, clock):
    store = make_store(runner, clock, ttl=60.0)
    open_prefilled(store, "a")
    clock.advance(30)
    open_prefilled(store, "b")
    clock.advance(30)
    assert store.evict_expired() == 0  # a is exactly ttl old: expiry is strictly after it
    clock.advance(0.5)
    assert store.evict_expired() == 1
    assert store.peek("a") is None and store.peek("b") is not None
    clock.advance(29.0)
    assert store.evict_expired() == 0
    clock.advance(1.0)
    assert store.evict_expired() == 1
    assert len(store) == 0 and store.evicted == 2


def test_get_and_reopen_refresh_the_ttl_but_attached_sessions_never_expire(runner, clock):
    store = make_store(runner, clock, ttl=10.0)
    a = open_prefilled(store, "a")
    b = open_prefilled(store, "b")
    c = open_prefilled(store, "c")
    clock.advance(8)
    store.get("a")
    store.open("b", PROMPT)
    c.attached = True
    clock.advance(8)  # 16 s since open, 8 s since a and b were last used
    assert store.evict_expired() == 0
    assert a.last_used == b.last_used == clock.now - 8
    clock.advance(1000)
    assert store.evict_expired() == 2
    assert store.peek("c") is c


def test_evict_expired_takes_an_explicit_time(runner, clock):
    store = make_store(runner, clock, ttl=5.0)
    open_prefilled(store, "a")
    assert store.evict_expired(now=clock.now + 4) == 0
    assert store.evict_expired(now=clock.now + 6) == 1


def test_release_drops_the_session_without_counting_an_eviction(runner, clock):
    store = make_store(runner, clock)
    open_prefilled(store, "a")
    assert store.release("a") is True
    assert store.release("a") is False
    assert store.release("never") is False
    assert len(store) == 0 and store.kv_bytes() == 0
    assert store.evicted == 0
    with pytest.raises(NotFound, match="unknown session 'a'"):
        store.get("a")


def test_peek_does_not_touch_recency(runner, clock):
    store = make_store(runner, clock, budget_tokens=2 * CACHED + 3)
    a = open_prefilled(store, "a")
    opened_at = a.last_used
    clock.advance(5)
    open_prefilled(store, "b")
    clock.advance(5)
    assert store.peek("a") is a
    assert a.last_used == opened_at
    assert store.peek("missing") is None
    open_prefilled(store, "c")  # a is still the least recently used, peek notwithstanding
    assert store.peek("a") is None and store.peek("b") is not None


def test_get_moves_the_session_to_the_back_of_the_eviction_line(runner, clock):
    store = make_store(runner, clock, budget_tokens=2 * CACHED + 3)
    a = open_prefilled(store, "a")
    open_prefilled(store, "b")
    clock.advance(3)
    assert store.get("a") is a and a.last_used == clock.now
    open_prefilled(store, "c")
    assert store.peek("b") is None and store.peek("a") is a


def test_unknown_sessions_raise_not_found(runner, clock):
    with pytest.raises(NotFound):
        make_store(runner, clock).get("nope")


def test_an_attached_session_cannot_be_reopened(runner, clock):
    store = make_store(runner, clock)
    open_prefilled(store, "a").attached = True
    with pytest.raises(FailedPrecondition, match="in use"):
        store.open("a", PROMPT)


def test_a_session_opened_without_an_id_is_ephemeral(runner, clock):
    store = make_store(runner, clock)
    s1, s2 = store.open("", PROMPT), store.open("", PROMPT)
    assert s1.ephemeral and s2.ephemeral
    assert s1.session_id.startswith("eph-") and s1.session_id != s2.session_id
    assert store.peek(s1.session_id) is s1
    assert not store.open("named", PROMPT).ephemeral


def test_a_new_turn_keeps_the_cached_prefix(runner, clock):
    store = make_store(runner, clock)
    a = open_prefilled(store, "a")
    seq = a.seq
    turn2 = [*PROMPT, 20, 21, 22]
    before = runner.prefix_tokens_reused
    store.open("a", turn2)
    runner.prefill(a.seq)
    assert a.seq is seq and a.seq.token_ids == turn2
    assert runner.prefix_tokens_reused - before == CACHED
    assert store.kv_bytes() == (len(turn2) - 1) * store.account.bytes_per_token


def test_a_request_that_cannot_fit_evicts_nobody(runner, clock):
    store = make_store(runner, clock, budget_tokens=3 * CACHED + 3)
    open_prefilled(store, "a").attached = True
    open_prefilled(store, "b")
    open_prefilled(store, "c")
    # 25 tokens need 25 of the 30: even with b and c gone, a's 9 leave 21. Evicting them would cost their
    # owners a prefill and still not fit.
    with pytest.raises(ResourceExhausted, match="KV cache budget full"):
        store.open("d", list(range(1, 26)))
    assert store.peek("b") is not None and store.peek("c") is not None and store.evicted == 0


def test_a_session_being_prefilled_is_busy(runner, clock):
    store = make_store(runner, clock, budget_tokens=2 * CACHED + 3, ttl=5.0)
    a = open_prefilled(store, "a")
    a.opening = True  # the engine marks a turn being prefilled: its cache is being written
    open_prefilled(store, "b")
    assert store.busy == 1 and store.attached == 0
    open_prefilled(store, "c")  # b goes, though a is older
    assert store.peek("a") is a and store.peek("b") is None
    with pytest.raises(FailedPrecondition, match="in use"):
        store.open("a", PROMPT)
    clock.advance(10)
    assert store.evict_expired() == 1 and store.peek("a") is a


# With BatchedRunner a session holds a whole slot: bytes are slot bytes, "budget reached" is "no slot free",
# and a slot goes back to the pool the moment its session is released, evicted or expired.


@pytest.fixture(scope="module")
def slot_runner():
    return BatchedRunner(tiny_model("llama", vocab=64, hidden=32, seed=3), num_slots=3, max_seq_len=64)


def make_slot_store(slot_runner, clock, ttl: float = 60.0) -> SessionStore:
    assert slot_runner.free_slots == slot_runner.num_slots  # every test starts from an empty pool
    return SessionStore(slot_runner, 2**30, ttl, clock=clock)


def release_all(store: SessionStore) -> None:
    for sid in [sid for sid in "abcdefgh" if store.peek(sid) is not None]:
        store.release(sid)


def test_slot_store_counts_whole_slots_and_frees_them_at_once(slot_runner, clock):
    store = make_slot_store(slot_runner, clock)
    assert store.budget_bytes == slot_runner.pool_bytes  # the pool caps a larger budget
    a = store.open("a", PROMPT)
    assert store.kv_bytes() == slot_runner.slot_bytes == slot_runner.kv_bytes()  # held before any prefill
    slot_runner.prefill(a.seq)
    open_prefilled(store, "b", [*PROMPT, *range(11, 40)])
    assert store.kv_bytes() == 2 * slot_runner.slot_bytes == slot_runner.kv_bytes()  # whatever the lengths
    assert slot_runner.free_slots == 1
    store.release("a")
    assert a.seq.freed and slot_runner.free_slots == 2 and store.kv_bytes() == slot_runner.slot_bytes
    clock.advance(100)
    assert store.evict_expired() == 1
    assert slot_runner.free_slots == 3 and store.kv_bytes() == 0


def test_slot_store_evicts_the_least_recently_used_idle_session_for_a_slot(slot_runner, clock):
    store = make_slot_store(slot_runner, clock)
    a, b, c = (open_prefilled(store, sid) for sid in "abc")
    assert slot_runner.free_slots == 0
    store.get("a")  # b is now the oldest
    b_slot = b.seq.slot
    d = open_prefilled(store, "d")
    assert store.peek("b") is None and b.seq.freed and store.evicted == 1
    assert d.seq.slot == b_slot  # the freed slot went straight to the new session
    assert {s.seq.slot for s in (a, c, d)} == {0, 1, 2}
    release_all(store)


def test_slot_store_reopening_needs_no_new_slot(slot_runner, clock):
    store = make_slot_store(slot_runner, clock)
    a = open_prefilled(store, "a")
    open_prefilled(store, "b").attached = True
    open_prefilled(store, "c").attached = True
    again = store.open("a", [*PROMPT, 20, 21])  # the pool is full, but a keeps its own slot
    assert again is a and store.evicted == 0 and slot_runner.free_slots == 0
    release_all(store)


def test_slot_store_with_every_slot_busy_raises_and_evicts_nobody(slot_runner, clock):
    store = make_slot_store(slot_runner, clock)
    open_prefilled(store, "a").attached = True
    open_prefilled(store, "b").opening = True
    open_prefilled(store, "c").attached = True
    with pytest.raises(ResourceExhausted) as err:
        store.open("d", PROMPT)
    assert err.value.code == "RESOURCE_EXHAUSTED"
    assert len(store) == 3 and store.evicted == 0 and slot_runner.free_slots == 0
    release_all(store)
    assert slot_runner.free_slots == 3

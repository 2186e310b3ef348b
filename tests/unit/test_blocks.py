"""The KV block allocator (specmesh.runtime.blocks): reference counts, prefix sharing by content hash within a
scope, rollback, LRU eviction, contiguous placement, all-or-nothing allocation, and a seeded random workload
that checks every invariant after each step, including that every table reads back exactly the tokens it
wrote (a shadow of the KV slots stands in for the tensors)."""

import itertools
import random

import pytest

from specmesh.errors import ResourceExhausted
from specmesh.runtime import blocks as blocks_module
from specmesh.runtime.blocks import (
    BlockManager,
    BlockPool,
    BlockTable,
    OutOfBlocks,
    block_hashes,
    scope_of,
)

BS = 4


def manager(num_blocks: int = 64, block_size: int = BS) -> BlockManager:
    return BlockManager(BlockPool(num_blocks, block_size))


def written(mgr: BlockManager, tokens: list[int], scope: bytes = b"") -> tuple[BlockTable, int]:
    """A table opened over `tokens`, with KV written for all of them and its full blocks committed."""
    table, cached = mgr.open(tokens, scope)
    mgr.reserve(table, len(tokens))
    table.mark_written(len(tokens))
    mgr.commit(table, tokens)
    return table, cached


def assert_writable_blocks_are_private(pool: BlockPool, table: BlockTable) -> None:
    """Every block holding a position at or past num_tokens (where the next write lands) is held by this
    table alone and is unregistered."""
    for b in table.blocks[table.num_tokens // table.block_size :]:
        assert pool.ref_count(b) == 1 and pool.hash_of(b) is None, b


def assert_pool_consistent(pool: BlockPool, tables: list[BlockTable]) -> None:
    holders = [0] * pool.num_blocks
    for t in tables:
        assert len(set(t.blocks)) == len(t.blocks), "a table holds a block twice"
        assert t.num_tokens <= t.capacity
        for b in t.blocks:
            holders[b] += 1
        assert_writable_blocks_are_private(pool, t)
    refs = [pool.ref_count(b) for b in range(pool.num_blocks)]
    assert refs == holders
    hashed = [pool.hash_of(b) is not None for b in range(pool.num_blocks)]
    used = sum(r > 0 for r in refs)
    cached = sum(r == 0 and h for r, h in zip(refs, hashed))
    free = [b for b in range(pool.num_blocks) if refs[b] == 0 and not hashed[b]]
    assert pool.num_used == used
    assert pool.num_shared == sum(r > 1 for r in refs)
    assert pool.num_cached == cached
    assert pool.num_free == len(free) + cached
    assert len(free) + used + cached == pool.num_blocks
    assert pool.usage == used / pool.num_blocks
    # The free runs are exactly the free blocks, maximal and disjoint.
    runs = pool.free_runs()
    assert [b for s, n in runs for b in range(s, s + n)] == free
    assert all(s1 + n1 < s2 for (s1, n1), (s2, _) in itertools.pairwise(runs))
    for b in range(pool.num_blocks):
        h = pool.hash_of(b)
        if h is not None:
            assert pool.lookup(h) == b
    assert 0 <= pool.prefix_hits <= pool.prefix_queries


# --- construction


@pytest.mark.parametrize("block_size", [0, 3, 12, 512, -4, 2.0, True, None])
def test_block_size_must_be_a_power_of_two_up_to_256(block_size):
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(8, block_size)
    with pytest.raises(ValueError, match="block_size"):
        BlockTable(block_size)


@pytest.mark.parametrize("block_size", [1, 2, 16, 256])
def test_valid_block_sizes(block_size):
    pool = BlockPool(8, block_size)
    assert (pool.block_size, pool.num_blocks, pool.num_free, pool.usage) == (block_size, 8, 8, 0.0)


@pytest.mark.parametrize("num_blocks", [0, -1, 2.5])
def test_num_blocks_must_be_positive(num_blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(num_blocks, BS)


# --- the pool: reference counts


def test_allocate_release_and_reference_counts():
    pool = BlockPool(8, BS)
    got = pool.allocate(3)
    assert got == [0, 1, 2]  # no table can grow into the pool's start: the run starts there
    assert pool.allocate(2) == [4, 5]  # the middle of the rest: room to grow for the table ending at 2
    pool.release([4, 5])
    assert [pool.ref_count(b) for b in got] == [1, 1, 1]
    assert (pool.num_used, pool.num_free, pool.num_shared, pool.usage) == (3, 5, 0, 3 / 8)

    pool.incref([got[0]])
    assert (pool.ref_count(got[0]), pool.num_shared, pool.num_used) == (2, 1, 3)
    pool.release([got[0]])
    assert (pool.ref_count(got[0]), pool.num_shared) == (1, 0)

    pool.release(got)
    assert (pool.num_used, pool.num_free, pool.num_cached) == (0, 8, 0)
    assert pool.free_runs() == [(0, 8)]  # merged back into one run
    assert_pool_consistent(pool, [])


def test_releasing_at_zero_and_increfing_a_free_block_are_bugs():
    pool = BlockPool(4, BS)
    (b,) = pool.allocate(1)
    pool.release([b])
    with pytest.raises(ValueError, match="already 0"):
        pool.release([b])
    with pytest.raises(ValueError, match="free block"):
        pool.incref([b])
    assert_pool_consistent(pool, [])


def test_allocate_arguments():
    pool = BlockPool(4, BS)
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)
    with pytest.raises(ValueError, match="after"):
        pool.allocate(1, after=4)
    with pytest.raises(ValueError, match="after"):
        pool.allocate(1, after=-1)
    assert pool.num_free == 4


def test_out_of_blocks_allocates_nothing():
    pool = BlockPool(4, BS)
    held = pool.allocate(3)
    runs, free = pool.free_runs(), pool.num_free
    with pytest.raises(OutOfBlocks) as info:
        pool.allocate(2)
    assert isinstance(info.value, ResourceExhausted) and info.value.retryable
    assert "2 needed, 1 of 4 free" in str(info.value)
    assert (pool.free_runs(), pool.num_free, pool.num_used) == (runs, free, 3)
    last = pool.allocate(1)
    pool.release(held + last)
    assert_pool_consistent(pool, [])


def test_reserve_is_atomic():
    mgr = manager(num_blocks=4)
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 6)
    before = list(table.blocks)
    with pytest.raises(OutOfBlocks):
        mgr.reserve(table, 6 + 3 * BS)  # 3 more blocks: only 2 left
    assert table.blocks == before and table.num_tokens == 0
    assert mgr.pool.num_used == 2
    mgr.reserve(table, 4 * BS)
    assert len(table.blocks) == 4


def test_cached_blocks_count_as_free_and_are_evicted_for_an_allocation():
    pool = BlockPool(4, BS)
    got = pool.allocate(4)
    for i, b in enumerate(got):
        assert pool.register(b, 100 + i)
    pool.release(got)
    assert (pool.num_free, pool.num_cached, pool.num_used) == (4, 4, 0)
    assert sorted(pool.allocate(4)) == sorted(got)
    assert (pool.evictions, pool.num_cached) == (4, 0)
    assert all(pool.lookup(100 + i) is None for i in range(4))


# --- the pool: the hash index and eviction


def test_register_keeps_the_first_block_of_a_content():
    pool = BlockPool(4, BS)
    a, b = pool.allocate(2)
    assert pool.register(a, 7)
    assert pool.register(a, 7)  # again, the same content: fine
    assert not pool.register(b, 7)  # no dedup: b stays unregistered
    assert (pool.lookup(7), pool.hash_of(b)) == (a, None)
    with pytest.raises(ValueError, match="immutable"):
        pool.register(a, 8)
    pool.release([b])
    with pytest.raises(ValueError, match="unheld"):
        pool.register(b, 9)
    pool.release([a])
    assert pool.num_cached == 1 and pool.num_free == 4


def test_eviction_is_least_recently_released_first_and_evicted_hashes_miss():
    pool = BlockPool(4, BS)
    got = pool.allocate(4)
    hashes = {b: 1000 + b for b in got}
    for b in got:
        pool.register(b, hashes[b])
    b0, b1, b2, b3 = got
    pool.release([b2, b0, b3, b1])  # LRU order: b2, b0, b3, b1

    assert pool.allocate(1) == [b2]
    assert pool.lookup(hashes[b2]) is None and pool.acquire(hashes[b2]) is None
    assert pool.evictions == 1
    assert sorted(pool.allocate(2)) == sorted([b0, b3])
    assert pool.lookup(hashes[b0]) is None and pool.lookup(hashes[b3]) is None
    assert pool.lookup(hashes[b1]) == b1 and pool.evictions == 3

    # A hit takes the block off the LRU: nothing is left to evict.
    assert pool.acquire(hashes[b1]) == b1
    assert (pool.num_cached, pool.num_free, pool.ref_count(b1)) == (0, 0, 1)
    with pytest.raises(OutOfBlocks):
        pool.allocate(1)


def test_a_hit_then_release_moves_a_block_to_the_young_end():
    pool = BlockPool(3, BS)
    got = pool.allocate(3)
    for b in got:
        pool.register(b, 50 + b)
    pool.release(got)  # LRU: got[0], got[1], got[2]
    assert pool.acquire(50 + got[0]) == got[0]
    pool.release([got[0]])  # now the youngest
    assert pool.allocate(2) == [got[1], got[2]]
    assert pool.lookup(50 + got[0]) == got[0]


def test_prefix_counters_count_blocks():
    pool = BlockPool(4, BS)
    (b,) = pool.allocate(1)
    pool.register(b, 1)
    assert pool.acquire_prefix([1, 2, 1]) == [b]  # stops at the first miss
    assert (pool.prefix_queries, pool.prefix_hits, pool.ref_count(b)) == (3, 1, 2)
    assert pool.acquire(2) is None and pool.acquire(1) == b
    assert (pool.prefix_queries, pool.prefix_hits, pool.ref_count(b)) == (5, 2, 3)
    assert pool.lookup(1) == b and pool.prefix_queries == 5  # a lookup is no query


# --- hashes


def test_incremental_hashing_equals_hashing_all_at_once():
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(37)]
    scope = scope_of("tenant", "salt")
    whole = block_hashes(tokens, BS, scope)
    assert len(whole) == 9  # the partial last block has no hash
    parts: list[int] = []
    for lo, hi in [(0, 8), (8, 20), (20, 24), (24, 37)]:
        parts += block_hashes(tokens[lo:hi], BS, scope, parts[-1] if parts else None)
    assert parts == whole
    assert len(set(whole)) == len(whole)
    # The chain carries every earlier block: changing token 0 changes every hash.
    other = block_hashes([tokens[0] + 1, *tokens[1:]], BS, scope)
    assert all(a != b for a, b in zip(whole, other))
    assert block_hashes(tokens[:3], BS, scope) == []


def test_hashes_are_stable_and_scoped():
    tokens = list(range(8))
    assert block_hashes(tokens, BS) == block_hashes(list(tokens), BS)
    a = block_hashes(tokens, BS, scope_of("a"))
    assert a != block_hashes(tokens, BS, scope_of("b"))
    assert a != block_hashes(tokens, BS, scope_of("a", "salt"))
    assert block_hashes(tokens, 2)[1] not in block_hashes(tokens, BS)
    # Length-prefixed parts: moving a character between tenant and salt is another scope.
    assert scope_of("ab", "") != scope_of("a", "b")
    # Fixed value: a change of the hash function (which would orphan nothing, but should be deliberate) shows.
    assert block_hashes([1, 2, 3, 4], 4)[0] == block_hashes([1, 2, 3, 4], 4)[0] > 0


def test_token_ids_must_fit_uint32():
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([0, 1, -1, 3], BS)
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([0, 1, 2**32, 3], BS)


# --- tables


def test_positions_slots_and_runs():
    table = BlockTable(BS)
    table.blocks = [5, 2]
    assert [table.position(i) for i in (0, 3, 4, 6)] == [20, 23, 8, 10]
    assert table.slots(2, 7) == [22, 23, 8, 9, 10]
    assert table.slots(3, 3) == []
    assert table.slots(0, 8) == [20, 21, 22, 23, 8, 9, 10, 11]
    with pytest.raises(IndexError):
        table.slots(0, 9)
    with pytest.raises(IndexError):
        table.position(-1)
    with pytest.raises(IndexError):
        table.position(8)

    table.blocks = [3, 4, 5, 9, 10, 2]
    assert table.runs() == [(3, 3), (9, 2), (2, 1)]
    table.blocks = []
    assert table.runs() == []


def test_mark_written_stays_within_capacity():
    mgr = manager()
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 5)
    assert table.capacity == 2 * BS
    table.mark_written(5)
    with pytest.raises(ValueError):
        table.mark_written(9)
    with pytest.raises(ValueError):
        table.mark_written(4)  # going back is truncate's job
    assert table.num_tokens == 5


# --- the manager


def test_two_tables_over_one_prefix_hold_its_blocks_once():
    mgr = manager()
    pool = mgr.pool
    prompt = list(range(10))  # two full blocks and two tokens
    a, cached = written(mgr, prompt)
    assert cached == 0 and pool.num_used == 3
    b, cached = mgr.open(prompt + [99], b"")
    assert cached == 2 * BS and b.num_tokens == 2 * BS
    assert b.blocks == a.blocks[:2]
    assert pool.num_shared == 2 and pool.num_used == 3
    assert [pool.ref_count(x) for x in a.blocks] == [2, 2, 1]
    mgr.reserve(b, 11)
    assert pool.num_used == 4
    assert_pool_consistent(pool, [a, b])

    mgr.free(a)
    assert pool.num_shared == 0 and [pool.ref_count(x) for x in b.blocks] == [1, 1, 1]
    assert pool.num_cached == 0  # still held by b
    mgr.free(b)
    assert pool.num_cached == 2 and pool.num_used == 0
    mgr.free(b)  # a second free is a no-op
    assert_pool_consistent(pool, [])


def test_whole_prompt_hit_leaves_the_last_block_to_compute():
    mgr = manager()
    pool = mgr.pool
    prompt = list(range(2 * BS))  # an exact multiple of the block size
    a, _ = written(mgr, prompt)
    mgr.free(a)
    assert pool.num_cached == 2
    second = pool.lookup(block_hashes(prompt, BS)[1])

    b, cached = mgr.open(prompt, b"")
    assert cached == BS and len(b.blocks) == 1  # the last token must be fed: its block is recomputed
    assert pool.num_cached == 1 and pool.lookup(block_hashes(prompt, BS)[1]) == second
    c, cached = mgr.open(prompt + [7], b"")  # one more token: every full block may be used
    assert cached == 2 * BS and c.blocks[1] == second
    d, cached = mgr.open(prompt[:BS], b"")
    assert cached == 0 and d.blocks == []
    e, cached = mgr.open([], b"")
    assert cached == 0 and e.blocks == [] and e.num_tokens == 0
    assert_pool_consistent(pool, [b, c, d, e])


@pytest.mark.parametrize(
    ("first", "second", "hit"),
    [
        (("acme", ""), ("acme", ""), True),
        (("acme", ""), ("globex", ""), False),
        (("acme", "s1"), ("acme", "s2"), False),
        (("acme", "s1"), ("acme", "s1"), True),
        (("acme", ""), ("acme", "s1"), False),
    ],
)
def test_prefixes_are_shared_within_a_scope_only(first, second, hit):
    mgr = manager()
    prompt = list(range(3 * BS + 1))
    a, _ = written(mgr, prompt, scope_of(*first))
    mgr.free(a)
    assert (mgr.pool.prefix_queries, mgr.pool.prefix_hits) == (3, 0)
    b, cached = mgr.open(prompt, scope_of(*second))
    assert cached == (3 * BS if hit else 0)
    assert (mgr.pool.prefix_queries, mgr.pool.prefix_hits) == (6, 3 if hit else 0)


def test_truncate_across_a_block_boundary():
    mgr = manager()
    pool = mgr.pool
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 10)
    table.mark_written(10)
    third = table.blocks[2]
    assert mgr.truncate(table, 5) == 5
    assert len(table.blocks) == 2 and table.num_tokens == 5
    assert pool.ref_count(third) == 0 and pool.num_cached == 0  # unregistered: back to free
    assert mgr.truncate(table, 4) == 4 and len(table.blocks) == 1  # on the boundary: the block goes
    assert mgr.truncate(table, 7) == 4 and len(table.blocks) == 1  # past what is written: nothing to do
    assert mgr.truncate(table, 0) == 0 and table.blocks == []
    assert_pool_consistent(pool, [table])
    with pytest.raises(ValueError):
        mgr.truncate(table, -1)


def test_truncate_gives_back_reserved_blocks_past_the_cut():
    mgr = manager()
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 5 * BS)
    table.mark_written(10)
    assert mgr.truncate(table, 12) == 10
    assert len(table.blocks) == 3 and mgr.pool.num_used == 3


def test_truncate_into_a_registered_block_returns_fewer_positions():
    mgr = manager()
    pool = mgr.pool
    tokens = list(range(10))
    table, _ = written(mgr, tokens)  # blocks 0 and 1 registered, block 2 holds 2 tokens
    second = table.blocks[1]
    assert pool.hash_of(second) is not None
    assert mgr.truncate(table, 6) == BS  # position 6 lies in the registered block: it is given back
    assert len(table.blocks) == 1 and table.num_tokens == BS
    assert pool.ref_count(second) == 0 and pool.lookup(pool.hash_of(second)) == second  # still cached
    assert_writable_blocks_are_private(pool, table)
    # Recompute the lost positions with new content: they go into a fresh block.
    mgr.reserve(table, 6)
    assert table.blocks[1] != second
    table.mark_written(6)
    mgr.commit(table, tokens[:6])
    assert_pool_consistent(pool, [table])


def test_truncate_into_a_shared_block_returns_fewer_positions():
    mgr = manager()
    pool = mgr.pool
    prompt = list(range(9))
    a, _ = written(mgr, prompt)
    b, cached = mgr.open(prompt, b"")
    assert cached == 2 * BS
    mgr.reserve(b, 9)
    b.mark_written(9)
    assert mgr.truncate(b, 6) == BS and b.blocks == a.blocks[:1]
    assert mgr.truncate(b, BS) == BS  # on the boundary the shared block stays: it is not written again
    assert_pool_consistent(pool, [a, b])
    assert_writable_blocks_are_private(pool, b)


def test_rollback_within_a_private_block_keeps_it():
    mgr = manager()
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 7)
    table.mark_written(7)
    before = list(table.blocks)
    assert mgr.truncate(table, 6) == 6 and table.blocks == before


def test_commit_registers_only_written_full_blocks_and_goes_on_from_where_it_stopped(monkeypatch):
    hashed = []
    real = blocks_module.block_hashes

    def counting(token_ids, *args, **kwargs):
        hashed.append(len(token_ids))
        return real(token_ids, *args, **kwargs)

    monkeypatch.setattr(blocks_module, "block_hashes", counting)
    mgr = manager()
    pool = mgr.pool
    scope = scope_of("t")
    tokens = list(range(100, 126))
    table, _ = mgr.open([], scope)
    mgr.reserve(table, len(tokens))
    for end in (3, 6, 9, 13, 20, 26):
        table.mark_written(end)
        mgr.commit(table, tokens)  # more ids than written: only written positions count
        assert [pool.hash_of(b) is not None for b in table.blocks] == [i < end // BS for i in range(7)]
    mgr.commit(table, tokens[:10])  # fewer ids than written: nothing new
    assert sum(hashed) == 6 * BS  # every full block hashed once
    assert [pool.hash_of(b) for b in table.blocks[:6]] == real(tokens, BS, scope)


def test_commit_uses_the_tables_scope():
    mgr = manager()
    prompt = list(range(2 * BS + 1))
    a, _ = written(mgr, prompt, scope_of("acme"))
    mgr.free(a)
    assert mgr.open(prompt, scope_of("acme"))[1] == 2 * BS
    assert mgr.open(prompt, b"")[1] == 0


def test_blocks_needed_and_can_allocate():
    mgr = manager(num_blocks=8)
    table, _ = mgr.open([], b"")
    assert mgr.blocks_needed(table, 0) == 0
    assert mgr.blocks_needed(table, 1) == 1
    assert mgr.blocks_needed(table, BS + 1) == 2
    mgr.reserve(table, BS + 1)
    assert mgr.blocks_needed(table, 2 * BS) == 0 and mgr.blocks_needed(table, 2 * BS + 1) == 1
    assert mgr.can_allocate(6) and not mgr.can_allocate(7)


def test_free_releases_the_tail_first_so_it_is_evicted_first():
    mgr = manager(num_blocks=4)
    pool = mgr.pool
    prompt = list(range(3 * BS + 1))
    a, _ = written(mgr, prompt)
    hashes = block_hashes(prompt, BS)
    mgr.free(a)
    pool.allocate(2)  # the free block and then one eviction: the chain's last block
    assert [pool.lookup(h) is not None for h in hashes] == [True, True, False]
    assert mgr.open(prompt, b"")[1] == 2 * BS


# --- contiguity


def test_a_growing_table_with_a_free_neighbour_stays_one_run():
    mgr = manager(num_blocks=64)
    table, _ = mgr.open([], b"")
    for n in range(1, 101):
        mgr.reserve(table, n)
    assert len(table.runs()) == 1 and len(table.blocks) == 25


def test_tables_growing_together_stay_one_run_each():
    mgr = manager(num_blocks=64)
    tables = [mgr.open([], b"")[0] for _ in range(4)]
    for n in range(1, 41):
        for t in tables:
            mgr.reserve(t, n)
    assert [len(t.runs()) for t in tables] == [1, 1, 1, 1]
    assert_pool_consistent(mgr.pool, tables)


def test_runs_after_fragmentation():
    pool = BlockPool(8, BS)
    mgr = BlockManager(pool)
    held = pool.allocate(8)
    pool.release([held[1], held[2], held[5]])  # free: 1, 2 and 5
    table, _ = mgr.open([], b"")
    mgr.reserve(table, 3 * BS)
    assert table.blocks == [1, 2, 5]  # the longest run first, then the next
    assert table.runs() == [(1, 2), (5, 1)]
    assert pool.free_runs() == []


def test_evicted_blocks_of_one_released_table_come_back_in_order():
    mgr = manager(num_blocks=8)
    pool = mgr.pool
    a, _ = written(mgr, list(range(4 * BS)))
    b, _ = mgr.open([], b"")
    mgr.reserve(b, 4 * BS)  # the pool is full now
    mgr.free(a)  # four registered blocks, released tail first
    c, _ = mgr.open([], b"")
    mgr.reserve(c, 4 * BS)
    assert pool.evictions == 4 and len(c.runs()) == 1


# --- a random workload


def test_random_workload_keeps_every_invariant():
    rng = random.Random(20240611)
    mgr = manager(num_blocks=48)
    pool = mgr.pool
    scopes = [scope_of("a"), scope_of("b"), scope_of("a", "salt")]
    prefixes = [[rng.randrange(6) for _ in range(3 * BS + 2)] for _ in range(3)]
    shadow: dict[int, tuple[bytes, int]] = {}  # physical slot -> (scope, token) whose KV it holds
    live: list[tuple[BlockTable, list[int]]] = []  # table, the tokens written at its positions
    seen = {"hit": 0, "lost": 0, "refused": 0}  # the workload reaches every path

    def write(table: BlockTable, tokens: list[int], start: int, end: int) -> None:
        for b in table.blocks[start // BS : (end + BS - 1) // BS]:
            assert pool.ref_count(b) == 1 and pool.hash_of(b) is None, "a write into a shared/registered block"
        for pos, slot in zip(range(start, end), table.slots(start, end)):
            shadow[slot] = (table.scope, tokens[pos])
        table.mark_written(end)

    def check() -> None:
        assert_pool_consistent(pool, [t for t, _ in live])
        for t, tokens in live:
            assert t.num_tokens == len(tokens)
            for i in range(t.num_tokens):
                assert shadow[t.position(i)] == (t.scope, tokens[i])

    for _ in range(3000):
        op = rng.random()
        if op < 0.2 or not live:
            scope = rng.choice(scopes)
            prompt = rng.choice(prefixes)[: rng.randrange(3 * BS + 3)] + [rng.randrange(6) for _ in range(3)]
            table, cached = mgr.open(prompt, scope)
            assert cached < len(prompt) and cached % BS == 0 and cached == table.num_tokens
            seen["hit"] += cached > 0
            try:
                mgr.reserve(table, len(prompt))
            except OutOfBlocks:
                assert table.num_tokens == cached and len(table.blocks) == cached // BS
                seen["refused"] += 1
                mgr.free(table)
                continue
            write(table, prompt, cached, len(prompt))
            live.append((table, prompt))
        elif op < 0.6:  # a verify step: K drafts written, some accepted
            table, tokens = rng.choice(live)
            n, k = table.num_tokens, rng.randrange(1, 6)
            try:
                mgr.reserve(table, n + k)
            except OutOfBlocks:
                continue
            drafts = [rng.randrange(6) for _ in range(k)]
            tokens += drafts
            write(table, tokens, n, n + k)
            keep = n + rng.randrange(k + 1)
            assert mgr.truncate(table, keep) == keep  # past what was cached before: always private
            del tokens[keep:]
        elif op < 0.75:  # a diverging turn: roll back somewhere, recompute what was lost
            table, tokens = rng.choice(live)
            cut = rng.randrange(table.num_tokens + 1)
            valid = mgr.truncate(table, cut)
            assert valid <= cut and cut - valid < BS
            seen["lost"] += valid < cut
            del tokens[valid:]
            assert_writable_blocks_are_private(pool, table)
        elif op < 0.9:
            table, tokens = rng.choice(live)
            mgr.commit(table, tokens + [rng.randrange(6)])  # one more id than written: it is not counted
        else:
            table, _ = live.pop(rng.randrange(len(live)))
            mgr.free(table)
            assert table.blocks == [] and table.num_tokens == 0
        check()

    assert all(seen.values()) and pool.evictions > 0, seen
    for table, _ in live:
        mgr.free(table)
    live.clear()
    check()
    assert pool.num_used == 0 and pool.num_free == pool.num_blocks


def test_extend_takes_the_blocks_another_table_committed_after_this_one_was_opened():
    mgr = manager()
    pool = mgr.pool
    prompt = list(range(100, 100 + 4 * BS + 2))  # four full blocks and two tokens
    late, cached = mgr.open(prompt, b"t")  # opened before anyone computed the prefix: nothing to share
    assert cached == 0 and mgr.extend(late, prompt) == 0
    first, _ = written(mgr, prompt[: 3 * BS], b"t")  # another table computes three of the four blocks
    other, _ = mgr.open(prompt, b"u")
    assert mgr.extend(other, prompt) == 0  # another scope: no hit
    assert mgr.extend(late, prompt) == 3 * BS and late.blocks == first.blocks and late.num_tokens == 3 * BS
    assert all(pool.ref_count(b) == 2 for b in first.blocks)
    # It goes on where it stopped: the fourth block, once committed, is found too.
    fourth, _ = written(mgr, prompt[: 4 * BS + 1], b"t")
    assert mgr.extend(late, prompt) == BS and late.num_tokens == 4 * BS
    assert mgr.extend(late, prompt) == 0  # never the block holding the last token
    assert_pool_consistent(pool, [first, late, other, fourth])


def test_extend_does_nothing_for_a_table_with_a_partial_or_uncommitted_block():
    mgr = manager()
    prompt = list(range(7, 7 + 3 * BS))
    written(mgr, prompt, b"")
    partial, _ = mgr.open(prompt[:2], b"")
    mgr.reserve(partial, 2)
    partial.mark_written(2)
    assert mgr.extend(partial, prompt) == 0  # ends inside a block
    private, _ = mgr.open([1] * BS, b"")
    mgr.reserve(private, BS)
    private.mark_written(BS)  # a full block of KV, not committed: what follows it is unknown
    assert mgr.extend(private, [1] * BS + prompt) == 0


def test_fork_puts_a_private_block_in_place_of_a_shared_one_before_a_truncate_inside_it():
    mgr = manager(num_blocks=8)
    pool = mgr.pool
    tokens = list(range(3 * BS))
    a, _ = written(mgr, tokens)
    b, _ = written(mgr, tokens)  # shares all three (the last one's hash names a's)
    assert b.blocks[:2] == a.blocks[:2] and pool.num_shared == 2
    old, new = mgr.fork(b, BS + 1)
    assert old == a.blocks[1] and b.blocks[1] == new != old
    assert pool.ref_count(old) == 1 and pool.ref_count(new) == 1 and pool.hash_of(new) is None
    assert mgr.truncate(b, BS + 1) == BS + 1  # the kept position survives: the caller copied it
    assert mgr.fork(b, BS + 1) is None  # private now: nothing to fork
    assert mgr.fork(b, 2 * BS) is None  # a block boundary: nothing kept of a block
    assert_pool_consistent(pool, [a, b])
    full = manager(num_blocks=3)
    c, _ = written(full, tokens)
    assert full.fork(c, BS + 1) is None and c.blocks[1] == 1  # no free block: truncate gives it back instead

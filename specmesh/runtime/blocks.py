"""The KV block allocator: KV in fixed-size blocks, a block table per sequence, full blocks shared by content
hash (vLLM's automatic prefix caching), scoped so that one tenant's prefix never serves another's.

Pure bookkeeping over block ids; the runner owns the KV tensors and indexes them by the slots a table names
(slot = block * block_size + offset).

* `BlockPool`: the physical blocks and their reference counts. A block is *free* (ref 0, no hash), *used*
  (ref > 0) or *cached* (ref 0 and still registered under its content hash: findable, and evicted least
  recently released first when no free block is left). free + used + cached == num_blocks.
* `block_hashes`: a hash per full block, chained over the token ids of every block before it and rooted in
  the scope (tenant and cache_salt), so equal hashes mean equal tokens at equal positions in one scope.
* `BlockTable`: one sequence's blocks in logical order and `num_tokens`, how many leading positions hold KV
  that was written.
* `BlockManager`: what a runner calls (open, reserve, truncate, commit, free).

Invariants the manager keeps (the tests check them after every step of a random workload):

* A block's reference count equals the number of tables holding it; a table holds a block at most once.
* A registered block is full and holds exactly the tokens its hash names: it is never written again.
* The runner writes only positions >= `table.num_tokens`, and every block holding such a position is held
  by that table alone and is unregistered. So a write never lands in a shared or registered block:
  `truncate` gives such a block back (and counts its positions as lost) rather than keep it for rewriting.
"""

from __future__ import annotations

import hashlib
import heapq
import struct
from collections import OrderedDict
from collections.abc import Iterable, Sequence

from specmesh.errors import ResourceExhausted

MAX_BLOCK_SIZE = 256
_DIGEST_BYTES = 16


class OutOfBlocks(ResourceExhausted):
    """The pool cannot meet an allocation; nothing was allocated."""


def check_block_size(block_size: int) -> int:
    if (
        not isinstance(block_size, int)
        or isinstance(block_size, bool)
        or not 1 <= block_size <= MAX_BLOCK_SIZE
        or block_size & (block_size - 1)
    ):
        raise ValueError(f"block_size must be a power of two in [1, {MAX_BLOCK_SIZE}], not {block_size!r}")
    return block_size


# ---------------------------------------------------------------------------------------------------------
# Content hashes
#
# blake2b over the parent digest and the block's token ids packed as little-endian uint32, kept to 128 bits.
# Not the built-in hash(): its value for ints is no secret and not stable across Python versions, and a
# collision here silently serves another prompt's KV (vLLM's prefix cache went to sha256 for that reason).
# 128 bits rather than 64 make even a deliberate birthday search within one scope out of reach; the cost is
# the same (one blake2b call per block, once per block of a sequence's life).


def scope_of(tenant: str, cache_salt: str = "") -> bytes:
    """The scope `block_hashes` roots its chain in: each part length-prefixed, so no two pairs collide."""
    t, s = tenant.encode(), cache_salt.encode()
    return len(t).to_bytes(4, "little") + t + len(s).to_bytes(4, "little") + s


def _root(scope: bytes, block_size: int) -> int:
    # The block size is mixed in too: hashes of one token run cut at different sizes never meet.
    h = hashlib.blake2b(b"specmesh-kv\0", digest_size=_DIGEST_BYTES)
    h.update(block_size.to_bytes(2, "little"))
    h.update(scope)
    return int.from_bytes(h.digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, scope: bytes = b"", parent: int | None = None) -> list[int]:
    """Chained hashes of the full blocks of `token_ids` (a partial last block gets none).

    h_i = H(h_{i-1}, tokens of block i), with h_{-1} = `parent` when given (the hash of the block before
    `token_ids[0]`: hashing a growing sequence block by block equals hashing it all at once), else a root
    derived from `scope` and `block_size`. With a parent the scope is already in the chain and is ignored.
    """
    n = len(token_ids) // block_size
    if n == 0:
        return []
    whole = token_ids if len(token_ids) == n * block_size else token_ids[: n * block_size]
    try:
        packed = struct.pack(f"<{n * block_size}I", *whole)
    except struct.error:
        raise ValueError("token ids must be ints in [0, 2**32)") from None
    h = _root(scope, block_size) if parent is None else parent
    step = 4 * block_size
    blake2b = hashlib.blake2b
    out = []
    for start in range(0, n * step, step):
        d = blake2b(h.to_bytes(_DIGEST_BYTES, "little"), digest_size=_DIGEST_BYTES)
        d.update(packed[start : start + step])
        h = int.from_bytes(d.digest(), "little")
        out.append(h)
    return out


# ---------------------------------------------------------------------------------------------------------
# The pool


class BlockPool:
    """Physical blocks 0..num_blocks-1 with reference counts and a content-hash index.

        Free blocks are kept as maximal runs (start -> end and end -> start, merged when a block comes back)
        with a max-heap of runs by length (lazy: an entry whose run has changed is dropped when it surfaces,
        and the heap is rebuilt when stale entries outnumber live runs). Cached blocks sit in an LRU ordered
        by release. Every operation is O(1) or O(log n) per block or run it touches.

        Placement keeps tables contiguous, since the CPU attention reads a table's consecutive blocks as one
        view: a table grows into the free run right after its last block; anything else goes to the middle of
        the largest free run, which leaves room on both sides for the tables that end there to grow (at its start
    when no table can end there: the pool's first block, or a cached block). (Taking
        the lowest free block instead interleaves tables that grow together block by block: in a simulation of
        16 tables growing to ~100 blocks each in a pool with room to spare, ~91 runs per table against ~1.)
        Once the prefix cache has filled every free block, new blocks come from evictions scattered over the
        pool and growing tables fragment under any placement (~90 runs per 100 blocks in the same simulation):
        a reader of a table must expect many runs.
    """

    __slots__ = (
        "_by_hash",
        "_hash",
        "_lru",
        "_num_plain_free",
        "_ref",
        "_run_end",
        "_run_start",
        "_runs",
        "block_size",
        "evictions",
        "num_blocks",
        "num_shared",
        "num_used",
        "prefix_hits",
        "prefix_queries",
    )

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = check_block_size(block_size)
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, not {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._num_plain_free = num_blocks
        self._run_end = {0: num_blocks}  # free run [start, end): start -> end
        self._run_start = {num_blocks: 0}  # end -> start
        self._runs = [(-num_blocks, 0, num_blocks)]  # (-length, start, end), longest first
        self.num_used = 0  # blocks with ref > 0
        self.num_shared = 0  # blocks with ref > 1
        self.evictions = 0
        self.prefix_queries = 0  # blocks looked up by acquire / acquire_prefix
        self.prefix_hits = 0

    # -- counters

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free and cached (evictable) ones."""
        return self._num_plain_free + len(self._lru)

    @property
    def num_cached(self) -> int:
        return len(self._lru)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (vLLM's kv_cache_usage_perc, as a fraction)."""
        return self.num_used / self.num_blocks

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def hash_of(self, block: int) -> int | None:
        return self._hash[block]

    def free_runs(self) -> list[tuple[int, int]]:
        """The free (never used or unregistered and released) runs as (first block, number of blocks), by
        first block. O(runs): for tests and diagnostics, not the hot path."""
        return sorted((s, e - s) for s, e in self._run_end.items())

    # -- allocation

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks with ref count 1: first the free run right after block `after`, then the middle of the
        largest free runs; when free blocks run out, cached blocks are evicted in LRU order. All or nothing:
        OutOfBlocks when free + cached blocks fall short."""
        if n <= 0:
            if n == 0:
                return []
            raise ValueError(f"cannot allocate {n} blocks")
        if after is not None and not 0 <= after < self.num_blocks:
            raise ValueError(f"after must be a block in [0, {self.num_blocks}), not {after}")
        avail = self._num_plain_free + len(self._lru)
        if n > avail:
            raise OutOfBlocks(f"KV cache out of blocks: {n} needed, {avail} of {self.num_blocks} free")
        out: list[int] = []
        rem = self._place(out, n, after)
        if rem:
            # Evicted blocks go through the free runs, so a run of them (a table released together sits
            # together in the LRU) comes out in ascending order, and one right after `after` is grown into.
            self._evict(rem)
            self._place(out, rem, out[-1] if out else after)
        self._num_plain_free -= n
        self.num_used += n
        return out

    def _place(self, out: list[int], rem: int, after: int | None) -> int:
        """Take up to `rem` free blocks into `out` (see allocate); returns how many are still wanted."""
        ref = self._ref
        if after is not None:
            # A free run starts at after + 1 only if `after` itself is not free.
            e = self._run_end.get(after + 1)
            if e is not None:
                s = after + 1
                k = min(rem, e - s)
                self._take(s, e, s, k)
                for b in range(s, s + k):
                    ref[b] = 1
                out.extend(range(s, s + k))
                rem -= k
        while rem:
            run = self._longest_run()
            if run is None:
                break
            s, e = run
            k = min(rem, e - s)
            # No table grows into a run that follows the pool's start or a cached block: start it there.
            m = s if s == 0 or ref[s - 1] == 0 else s + (e - s - k) // 2
            self._take(s, e, m, k)
            for b in range(m, m + k):
                ref[b] = 1
            out.extend(range(m, m + k))
            rem -= k
        return rem

    def _evict(self, k: int) -> None:
        """Drop the hashes of the `k` least recently released cached blocks; they become free."""
        k = min(k, len(self._lru))
        lru, by_hash, hashes = self._lru, self._by_hash, self._hash
        for _ in range(k):
            b, _ = lru.popitem(last=False)
            del by_hash[hashes[b]]  # type: ignore[arg-type]
            hashes[b] = None
            self._add_free(b)
        self._num_plain_free += k
        self.evictions += k

    def _longest_run(self) -> tuple[int, int] | None:
        runs, run_end = self._runs, self._run_end
        while runs:
            _, s, e = runs[0]
            if run_end.get(s) == e:
                return s, e
            heapq.heappop(runs)
        return None

    def _take(self, s: int, e: int, m: int, k: int) -> None:
        """Take blocks [m, m + k) out of the free run [s, e)."""
        del self._run_end[s]
        del self._run_start[e]
        if m > s:
            self._add_run(s, m)
        if m + k < e:
            self._add_run(m + k, e)

    def _add_run(self, s: int, e: int) -> None:
        self._run_end[s] = e
        self._run_start[e] = s
        runs = self._runs
        if len(runs) > 2 * len(self._run_end) + 64:
            runs[:] = [(s1 - e1, s1, e1) for s1, e1 in self._run_end.items()]
            heapq.heapify(runs)
        else:
            heapq.heappush(runs, (s - e, s, e))

    def _add_free(self, b: int) -> None:
        """Block `b` becomes free: merged with the free runs that end at it and start right after it."""
        s = self._run_start.pop(b, b)
        if s != b:
            del self._run_end[s]
        e = self._run_end.pop(b + 1, b + 1)
        if e != b + 1:
            del self._run_start[e]
        self._add_run(s, e)

    # -- reference counts

    def incref(self, blocks: Iterable[int]) -> None:
        """One more reference to each block; a cached block comes off the LRU. A free block is a bug."""
        blocks = list(blocks)
        ref, hashes = self._ref, self._hash
        for b in blocks:
            if ref[b] == 0 and hashes[b] is None:
                raise ValueError(f"incref of free block {b}")
        for b in blocks:
            self._incref(b)

    def _incref(self, b: int) -> None:
        r = self._ref[b]
        if r == 0:
            del self._lru[b]
            self.num_used += 1
        elif r == 1:
            self.num_shared += 1
        self._ref[b] = r + 1

    def release(self, blocks: Iterable[int]) -> None:
        """One reference fewer to each block, in order. At 0 a registered block joins the LRU's young end
        (so, of blocks released together, the first is evicted first); any other becomes free. Releasing
        a block whose count is already 0 is a bug: raises, with the blocks before it released."""
        ref, hashes = self._ref, self._hash
        for b in blocks:
            r = ref[b]
            if r > 1:
                ref[b] = r - 1
                if r == 2:
                    self.num_shared -= 1
                continue
            if r == 0:
                raise ValueError(f"release of block {b}, whose reference count is already 0")
            ref[b] = 0
            self.num_used -= 1
            if hashes[b] is not None:
                self._lru[b] = None
            else:
                self._num_plain_free += 1
                self._add_free(b)

    # -- the content-hash index

    def register(self, block: int, block_hash: int) -> bool:
        """Record that `block`, which is full and held, holds exactly the content `block_hash` names.
        False (and the block stays unregistered) when another block already holds that content."""
        if self._ref[block] == 0:
            raise ValueError(f"register of unheld block {block}")
        current = self._hash[block]
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block} is registered under another hash: its content is immutable")
            return True
        if block_hash in self._by_hash:
            return False
        self._by_hash[block_hash] = block
        self._hash[block] = block_hash
        return True

    def lookup(self, block_hash: int) -> int | None:
        """The block registered under `block_hash`, taking no reference (and counting no query)."""
        return self._by_hash.get(block_hash)

    def acquire(self, block_hash: int) -> int | None:
        """The block registered under `block_hash` with one more reference, or None."""
        self.prefix_queries += 1
        b = self._by_hash.get(block_hash)
        if b is not None:
            self.prefix_hits += 1
            self._incref(b)
        return b

    def acquire_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The blocks of the longest prefix of `hashes` that is registered, each with one more reference
        (a chain is useless past its first miss, so the lookup stops there)."""
        by_hash = self._by_hash
        out = []
        for h in hashes:
            b = by_hash.get(h)
            if b is None:
                break
            self._incref(b)
            out.append(b)
        self.prefix_queries += len(hashes)
        self.prefix_hits += len(out)
        return out


# ---------------------------------------------------------------------------------------------------------
# Tables and the manager


class BlockTable:
    """One sequence's blocks in logical order. `num_tokens`: how many leading positions hold written KV
    (the runner advances it with `mark_written` after writing, `truncate` lowers it). `capacity`: positions
    its blocks cover; positions in [num_tokens, capacity) are reserved for writing."""

    __slots__ = ("_hashes", "_mask", "_registered", "_shift", "block_size", "blocks", "num_tokens", "scope")

    def __init__(self, block_size: int, scope: bytes = b""):
        self.block_size = check_block_size(block_size)
        self.scope = scope
        self.blocks: list[int] = []
        self.num_tokens = 0
        self._shift = block_size.bit_length() - 1
        self._mask = block_size - 1
        # Content hashes of the leading full blocks, as far as computed (commit goes on from the last), and
        # how many leading blocks commit has offered to the pool's index.
        self._hashes: list[int] = []
        self._registered = 0

    @property
    def capacity(self) -> int:
        return len(self.blocks) << self._shift

    def mark_written(self, end: int) -> None:
        """Positions [num_tokens, end) now hold KV."""
        if not self.num_tokens <= end <= self.capacity:
            raise ValueError(f"cannot mark {end} positions written: {self.num_tokens} are, {self.capacity} fit")
        self.num_tokens = end

    def position(self, i: int) -> int:
        """The physical token slot of logical position `i`."""
        if i < 0:
            raise IndexError(f"position {i}")
        return (self.blocks[i >> self._shift] << self._shift) | (i & self._mask)

    def slots(self, start: int, end: int) -> list[int]:
        """The physical token slots of positions [start, end), in order."""
        if not 0 <= start <= end <= self.capacity:
            raise IndexError(f"positions [{start}, {end}) outside [0, {self.capacity})")
        blocks, shift, bs = self.blocks, self._shift, self.block_size
        out: list[int] = []
        i = start
        while i < end:
            base = (blocks[i >> shift] << shift) | (i & self._mask)
            n = min(bs - (i & self._mask), end - i)
            out.extend(range(base, base + n))
            i += n
        return out

    def runs(self) -> list[tuple[int, int]]:
        """Maximal runs of physically consecutive blocks, in logical order: (first block, number of blocks)."""
        out: list[tuple[int, int]] = []
        blocks = self.blocks
        if not blocks:
            return out
        first = prev = blocks[0]
        for b in blocks[1:]:
            if b != prev + 1:
                out.append((first, prev - first + 1))
                first = b
            prev = b
        out.append((first, prev - first + 1))
        return out


class BlockManager:
    """A runner's block bookkeeping over one pool: open a table from a prompt (sharing its cached prefix),
    reserve blocks before writing, roll back, register what is committed, free."""

    __slots__ = ("_mask", "_shift", "block_size", "pool")

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self._shift = pool.block_size.bit_length() - 1
        self._mask = pool.block_size - 1

    def open(self, token_ids: Sequence[int], scope: bytes = b"") -> tuple[BlockTable, int]:
        """A new table for a sequence of `token_ids` in `scope`, holding the cached blocks of its longest
        cached prefix, and how many tokens those hold.

        The last token is never among them: the next forward must feed it to get its logits. So only the
        full blocks of token_ids[:-1] are looked up; a prompt whose every block is cached and whose length
        is a multiple of block_size gets all but its last block (which is left as it is in the cache,
        rather than taken and given back, so its place in the LRU does not move)."""
        table = BlockTable(self.block_size, scope)
        n = max(len(token_ids) - 1, 0) >> self._shift
        if n:
            hashes = block_hashes(token_ids[: n << self._shift], self.block_size, scope)
            table._hashes = hashes
            table.blocks = self.pool.acquire_prefix(hashes)
            table._registered = len(table.blocks)
            table.num_tokens = len(table.blocks) << self._shift
        return table, table.num_tokens

    def extend(self, table: BlockTable, token_ids: Sequence[int]) -> int:
        """Take the cached blocks of `token_ids`' next full blocks past the table's end, as `open` does at
        the start: for a prompt whose prefix another sequence finished computing after this one was opened
        (sessions admitted together behind one system prompt), or a preempted sequence coming back. Only a
        table that ends at a block boundary with every block committed can grow this way; the lookup stops
        at the first miss. Returns the positions gained (their KV is written: `num_tokens` moves too).

        Misses count no query (`open` counted those blocks already); hits count a hit."""
        n = len(table.blocks)
        shift = self._shift
        hashes = table._hashes  # may run past the table's blocks: `open` hashes the whole prompt
        if table.num_tokens != n << shift or table._registered != n or len(hashes) < n:
            return 0
        full = max(len(token_ids) - 1, 0) >> shift  # never the last token, as in open
        pool, got = self.pool, 0
        for i in range(n, full):
            if i == len(hashes):
                parent = hashes[-1] if hashes else None
                more = token_ids[i << shift : (i + 1) << shift]
                hashes.append(block_hashes(more, self.block_size, table.scope, parent)[0])
            b = pool.lookup(hashes[i])
            if b is None:
                break
            pool.incref((b,))
            pool.prefix_hits += 1
            table.blocks.append(b)
            got += 1
        table._registered += got
        table.num_tokens += got << shift
        return got << shift

    def blocks_needed(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks `reserve(table, num_tokens)` would allocate."""
        return max(0, ((num_tokens + self._mask) >> self._shift) - len(table.blocks))

    def can_allocate(self, n: int) -> bool:
        return n <= self.pool.num_free

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make `table` cover `num_tokens` positions, new blocks placed right after its last where free.
        Raises OutOfBlocks with the table unchanged."""
        need = ((num_tokens + self._mask) >> self._shift) - len(table.blocks)
        if need > 0:
            table.blocks += self.pool.allocate(need, table.blocks[-1] if table.blocks else None)

    def fork(self, table: BlockTable, num_tokens: int) -> tuple[int, int] | None:
        """Copy on write, before `truncate(table, num_tokens)`: where the block holding position `num_tokens`
        is shared or registered (so truncate would give it back, and its first positions would be computed
        again), a private block takes its place in the table. Returns (old block, new block): the caller copies
        the first `num_tokens % block_size` positions' KV across before anything else allocates. None when
        there is nothing to fork, or no block to fork into."""
        valid = min(num_tokens, table.num_tokens)
        k = valid >> self._shift
        if not valid & self._mask or k >= len(table.blocks):
            return None
        old = table.blocks[k]
        if self.pool.ref_count(old) == 1 and self.pool.hash_of(old) is None:
            return None
        try:
            new = self.pool.allocate(1, table.blocks[k - 1] if k else None)[0]
        except OutOfBlocks:
            return None
        table.blocks[k] = new
        self.pool.release((old,))  # still referenced or cached: its KV stays put for the copy
        del table._hashes[k:]
        table._registered = min(table._registered, k)
        return old, new

    def truncate(self, table: BlockTable, num_tokens: int) -> int:
        """Keep the KV of the first `num_tokens` positions only (rejected drafts, a prompt that diverges) and
        give back the blocks wholly past them. Returns how many positions still hold valid KV.

        Invariant: no write ever lands in a shared or registered block. If the block holding position
        `num_tokens` would be written again but is shared (ref > 1) or registered, it is given back too and
        the count returned stops at its start: the caller recomputes the positions in between."""
        if num_tokens < 0:
            raise ValueError(f"cannot truncate to {num_tokens} positions")
        blocks, shift = table.blocks, self._shift
        valid = min(num_tokens, table.num_tokens)
        keep = (num_tokens + self._mask) >> shift
        k = valid >> shift
        if valid & self._mask and k < len(blocks):
            b = blocks[k]
            if self.pool.ref_count(b) > 1 or self.pool.hash_of(b) is not None:
                keep, valid = k, k << shift
        if keep < len(blocks):
            # Tail first: of the blocks that stay cached, a chain's later blocks are evicted before its
            # earlier ones (a later block is useless once an earlier one is gone).
            self.pool.release(reversed(blocks[keep:]))
            del blocks[keep:]
        table.num_tokens = valid
        # Whatever comes after `valid` may be written with other tokens: their hashes go too.
        del table._hashes[valid >> shift :]
        table._registered = min(table._registered, valid >> shift)
        return valid

    def commit(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Register the content hashes of the table's blocks now full of written KV for `token_ids` (the
        sequence's committed ids), going on from where the last call stopped.

        Only positions below both len(token_ids) and table.num_tokens count, so call it after `truncate`
        has dropped rejected drafts: a position holding a draft's KV must not be named by a committed id.
        The table's own scope roots the hashes (open's), so a commit cannot register under another tenant."""
        full = min(len(token_ids), table.num_tokens) >> self._shift
        start = table._registered
        if full <= start:
            return
        hashes = table._hashes
        if len(hashes) < full:
            h0 = len(hashes)
            more = token_ids[h0 << self._shift : full << self._shift]
            hashes += block_hashes(more, self.block_size, table.scope, hashes[-1] if hashes else None)
        register, blocks = self.pool.register, table.blocks
        for i in range(start, full):
            register(blocks[i], hashes[i])
        table._registered = full

    def free(self, table: BlockTable) -> None:
        """Give back every block (tail first, as truncate does); the table is left empty and reusable."""
        if table.blocks:
            self.pool.release(reversed(table.blocks))
        table.blocks = []
        table.num_tokens = 0
        table._hashes = []
        table._registered = 0

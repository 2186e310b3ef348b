"""Sessions: the committed tokens and target KV cache of one conversation, kept across rounds and turns.

A later turn names its session and sends the whole conversation; the longest common prefix of the
cached tokens is reused and only the rest is prefilled. Sessions that nothing is using are evicted
least-recently-used first when a new one does not fit, and after `ttl_seconds` idle. Busy sessions (a
stream or generate call attached, or a turn being prefilled) are never evicted.

What a session holds is the runner's to say (`Runner.kv_account`): with a slot pool one whole slot from
creation to release (so "no slot free" and "budget reached" are the same thing, and the slot goes back
to the pool the moment the session is released, evicted or expired); with growing caches a cache that
grows token by token (counted by the bytes its key/value tensors' storages really hold, which a cropped
cache keeps until it grows again; it is freed with its last reference).

Besides bytes, the number of sessions is capped (`max_count`; a pool's slot count caps it too): every
session counts, idle cached ones included, so a flood of opens can never grow the store past it. A new
session beyond both bounds first evicts idle sessions LRU, and gets RESOURCE_EXHAUSTED when only busy ones
are left.

Every timestamp (LRU recency, TTL expiry) comes from the store's `clock`, so tests can drive time
instead of sleeping.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from specmesh.errors import FailedPrecondition, NotFound, ResourceExhausted
from specmesh.runtime import KvAccount, Runner
from specmesh.sampling import SamplingParams, StopChecker

EPHEMERAL_PREFIX = "eph-"  # the names of sessions created without one


@dataclass
class Session:
    session_id: str
    # The runner's own kind of sequence (a RunnerSequence): the session is agnostic of which, and the
    # runner checks that it is given its own.
    seq: Any
    ephemeral: bool  # created without an id (or with one of EPHEMERAL_PREFIX): released when its stream ends
    # Per turn:
    params: SamplingParams | None = None
    stop: StopChecker | None = None
    generator: torch.Generator | None = None  # seeded requests' own stream
    grammar: Any = None  # structured output's matcher state (specmesh.structured.Grammar), if any
    prompt_len: int = 0
    epoch: int = 0  # verdicts produced this turn
    run_steps: int = 0  # target-only steps still to take of a run the client asked for
    admitted: int = 0  # KV blocks: this turn's place in the admission order (0: not yet admitted)
    # Bookkeeping:
    attached: bool = False  # a Verify stream or a Generate call is using it
    opening: bool = False  # its turn is being prefilled: its cache is being written
    attach_by: float | None = None  # an opened turn not yet attached is released past this (store's clock)
    # The attached Verify stream's inbox and when its client last sent (time.monotonic), so that a newer turn
    # can take over a session whose stream has gone silent (VerifyEngine._wait_detached).
    inbox: Any = None
    heard: float = 0.0
    last_used: float = field(default_factory=time.monotonic)

    @property
    def busy(self) -> bool:
        """In use: never evicted, expired or released from under its user."""
        return self.attached or self.opening

    @property
    def finished(self) -> bool:
        return self.stop is not None and self.stop.finished

    @property
    def position(self) -> int:
        """Committed tokens (prompt + output) = the base position of the next block."""
        return len(self.seq.token_ids)


class SessionStore:
    """`budget_bytes`: the most KV the sessions may hold (at most the runner's pool, if it has one).
    `bytes_per_token`: KV bytes per cached token where caches grow by the token (default: the model's).
    `max_count`: the most sessions held, busy or idle (None: the pool's slot count, else no cap of its own)."""

    def __init__(
        self,
        runner: Runner[Any],
        budget_bytes: int,
        ttl_seconds: float,
        bytes_per_token: int | None = None,
        clock: Callable[[], float] = time.monotonic,
        max_count: int | None = None,
    ):
        self.runner = runner
        self.clock = clock  # seconds, monotonic: only differences between its readings matter
        self.ttl_seconds = ttl_seconds
        self.account: KvAccount[Any] = runner.kv_account(bytes_per_token)
        pool, cap = self.account.pool_bytes, self.account.max_sequences
        self.budget_bytes = budget_bytes if pool is None else min(budget_bytes, pool)
        if cap is not None:
            max_count = min(max_count or cap, cap)
        self.max_count = max_count or 2**62
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self.evicted = 0
        self.on_free: Callable[[], None] | None = None  # told whenever a session's KV goes back
        # Runs a release's freeing once no forward in flight touches the session (the scheduler's
        # `after_pass`): an opened turn is answered while the pass computing its prompt's last chunk runs,
        # and may be released (ReleaseSession, or evicted when the store is full) before that pass ends.
        self.after_pass: Callable[[Session, Callable[[], None]], None] | None = None

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def attached(self) -> int:
        return sum(s.attached for s in self._sessions.values())

    def busy_sessions(self) -> list[Session]:
        """The sessions attached or being prefilled."""
        return [s for s in self._sessions.values() if s.busy]

    @property
    def busy(self) -> int:
        """Sessions attached or being prefilled: what counts against the concurrency limit."""
        return sum(s.busy for s in self._sessions.values())

    def kv_bytes(self) -> int:
        blocks, pool = self.runner.blocks, self.account.pool_bytes
        if blocks is not None and pool is not None:  # blocks in use, a shared one once
            return pool * (blocks.num_blocks - blocks.free_blocks()) // blocks.num_blocks
        return sum(self.account.held(s.seq) for s in self._sessions.values())

    def peek(self, session_id: str) -> Session | None:
        """The session if it exists, without touching its LRU position."""
        return self._sessions.get(session_id)

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise NotFound(f"unknown session {session_id!r} (never opened, released or evicted)")
        self._sessions.move_to_end(session_id)
        session.last_used = self.clock()
        return session

    def open(self, session_id: str, prompt_ids: list[int], scope: str = "") -> Session:
        """The session for a new turn (created if needed); the caller prefills it. `scope`: the prefix-cache
        scope a new session's cache is shared in (the gateway's per tenant and cache_salt)."""
        session = self._sessions.get(session_id) if session_id else None
        if session is not None and session.busy:
            raise FailedPrecondition(f"session {session_id!r} is in use by another stream")
        if session is None:
            self._make_count_room()
        self.make_room(self.account.needed(session.seq if session is not None else None, len(prompt_ids)), keep=session)
        if session is None:
            # A name in the ephemeral namespace (one this store gave out, named again by a caller continuing
            # that generation) stays ephemeral when its session is gone: nobody would release it otherwise.
            session = Session(
                session_id or f"{EPHEMERAL_PREFIX}{uuid.uuid4().hex}",
                self.runner.new_sequence(prompt_ids, scope.encode()),
                ephemeral=not session_id or session_id.startswith(EPHEMERAL_PREFIX),
            )
            self._sessions[session.session_id] = session
        else:
            session.seq.reset_tokens(prompt_ids)
            session.admitted = 0
        self._sessions.move_to_end(session.session_id)
        session.last_used = self.clock()
        return session

    def _make_count_room(self) -> None:
        """Evict the LRU idle session when a new one would pass `max_count`."""
        if len(self._sessions) < self.max_count:
            return
        idle = next((sid for sid, s in self._sessions.items() if not s.busy), None)
        if idle is None:
            raise ResourceExhausted(f"session cap reached: all {len(self._sessions)} sessions are in use")
        self._drop(idle)

    def make_room(self, need: int, keep: Session | None = None) -> None:
        """Evict idle sessions (LRU) until `need` more bytes fit the budget. If evicting every idle session
        would still not make room, raise RESOURCE_EXHAUSTED and evict nobody: dropping caches that cannot
        help would only cost their owners a prefill."""
        held = self.kv_bytes()
        if held + need <= self.budget_bytes:
            return
        idle = [sid for sid, s in self._sessions.items() if s is not keep and not s.busy]  # oldest first
        if held - sum(self.account.held(self._sessions[sid].seq) for sid in idle) + need > self.budget_bytes:
            raise ResourceExhausted(
                f"KV cache budget full: {held} of {self.budget_bytes} bytes held, most by "
                f"sessions in use; {need} more needed"
            )
        for sid in idle:
            held -= self.account.held(self._sessions[sid].seq)
            self._drop(sid)
            if held + need <= self.budget_bytes:
                return

    def release(self, session_id: str) -> bool:
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        self.free(session)
        return True

    def free(self, session: Session) -> None:
        """Give a session's KV back (one this store no longer holds: released or `remove`d), once no
        forward in flight touches it."""
        if self.after_pass is None:
            self._free_now(session)
        else:
            self.after_pass(session, lambda: self._free_now(session))

    def _free_now(self, session: Session) -> None:
        self.runner.free(session.seq)
        if self.on_free is not None:
            self.on_free()

    def reclaim(self, blocks: int) -> int:
        """KV in blocks: evict idle sessions holding blocks, least recently used first, until `blocks` more
        are free or none is left; returns how many became free."""
        budget = self.runner.blocks
        if budget is None:
            return 0
        before = budget.free_blocks()
        for sid, s in list(self._sessions.items()):
            if budget.free_blocks() - before >= blocks:
                break
            # An opened turn that its stream has yet to attach to is about to run: not idle.
            if not s.busy and s.attach_by is None and budget.held(s.seq):
                self._drop(sid)
        return budget.free_blocks() - before

    def remove(self, session: Session) -> bool:
        """Forget `session` (if it is still the one under its id) without freeing its KV: the caller frees
        it (`free`)."""
        if self._sessions.get(session.session_id) is not session:
            return False
        del self._sessions[session.session_id]
        return True

    def release_unattached(self, now: float | None = None) -> int:
        """Release opened turns that no stream attached to in time."""
        now = self.clock() if now is None else now
        late = [
            sid for sid, s in self._sessions.items() if not s.busy and s.attach_by is not None and now > s.attach_by
        ]
        for sid in late:
            self._drop(sid)
        return len(late)

    def evict_expired(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        old = [sid for sid, s in self._sessions.items() if not s.busy and now - s.last_used > self.ttl_seconds]
        for sid in old:
            self._drop(sid)
        return len(old)

    def _drop(self, session_id: str) -> None:
        self.release(session_id)
        self.evicted += 1

"""Sessions: the committed tokens and target KV cache of one conversation, kept across rounds and turns.

A later turn names its session and sends the whole conversation; the longest common prefix of the
cached tokens is reused and only the rest is prefilled (`ModelRunner.prefill`). Sessions that no stream
is using are evicted least-recently-used first when the KV budget is exceeded, and after `ttl_seconds`
idle. Attached sessions (a stream or generate call in progress) are never evicted.

Every timestamp (LRU recency, TTL expiry) comes from the store's `clock`, so tests can drive time
instead of sleeping.
"""

from __future__ import annotations

import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specmesh.errors import FailedPrecondition, NotFound, ResourceExhausted
from specmesh.runtime.hf import ModelRunner, Sequence
from specmesh.sampling import SamplingParams, StopChecker


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys + values of one token over all layers."""
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * kv_heads * head_dim * elem


@dataclass
class Session:
    session_id: str
    seq: Sequence
    ephemeral: bool  # created without an id: released when its stream ends
    # Per turn:
    params: SamplingParams | None = None
    stop: StopChecker | None = None
    generator: torch.Generator | None = None  # seeded requests' own stream
    prompt_len: int = 0
    epoch: int = 0  # verdicts produced this turn
    # Bookkeeping:
    attached: bool = False
    last_used: float = field(default_factory=time.monotonic)

    @property
    def finished(self) -> bool:
        return self.stop is not None and self.stop.finished

    @property
    def position(self) -> int:
        """Committed tokens (prompt + output) = the base position of the next block."""
        return len(self.seq.token_ids)


class SessionStore:
    def __init__(self, runner: ModelRunner, budget_bytes: int, ttl_seconds: float, bytes_per_token: int,
                 clock: Callable[[], float] = time.monotonic):
        self.runner = runner
        self.clock = clock  # seconds, monotonic: only differences between its readings matter
        self.budget_bytes = budget_bytes
        self.ttl_seconds = ttl_seconds
        self.bytes_per_token = bytes_per_token
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # LRU order: oldest first
        self.evicted = 0

    def __len__(self) -> int:
        return len(self._sessions)

    @property
    def attached(self) -> int:
        return sum(s.attached for s in self._sessions.values())

    def kv_bytes(self) -> int:
        return sum(s.seq.num_cached for s in self._sessions.values()) * self.bytes_per_token

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

    def open(self, session_id: str, prompt_ids: list[int]) -> Session:
        """The session for a new turn (created if needed); the caller prefills it."""
        session = self._sessions.get(session_id) if session_id else None
        if session is not None and session.attached:
            raise FailedPrecondition(f"session {session_id!r} is in use by another stream")
        self.make_room(len(prompt_ids), keep=session)
        if session is None:
            session = Session(session_id or f"eph-{uuid.uuid4().hex}", self.runner.new_sequence(prompt_ids),
                              ephemeral=not session_id)
            self._sessions[session.session_id] = session
        else:
            session.seq.reset_tokens(prompt_ids)
        self._sessions.move_to_end(session.session_id)
        session.last_used = self.clock()
        return session

    def make_room(self, new_tokens: int, keep: Session | None = None) -> None:
        """Evict idle sessions (LRU) until `new_tokens` more fit the budget; RESOURCE_EXHAUSTED if they cannot."""
        need = new_tokens * self.bytes_per_token
        if self.kv_bytes() + need <= self.budget_bytes:
            return
        for sid in list(self._sessions):
            s = self._sessions[sid]
            if s is keep or s.attached:
                continue
            self._drop(sid)
            if self.kv_bytes() + need <= self.budget_bytes:
                return
        raise ResourceExhausted(f"KV cache budget full: {self.kv_bytes()} of {self.budget_bytes} bytes held by "
                                f"active sessions; {need} more needed")

    def release(self, session_id: str) -> bool:
        if session_id in self._sessions:
            del self._sessions[session_id]
            return True
        return False

    def evict_expired(self, now: float | None = None) -> int:
        now = self.clock() if now is None else now
        old = [sid for sid, s in self._sessions.items() if not s.attached and now - s.last_used > self.ttl_seconds]
        for sid in old:
            self._drop(sid)
        return len(old)

    def _drop(self, session_id: str) -> None:
        del self._sessions[session_id]
        self.evicted += 1

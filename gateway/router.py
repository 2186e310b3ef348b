"""The gateway's router: where each stream of a generation goes. `Router.route` takes what the request asks
(session, prompt, K, seed) and what its generation went through (tokens emitted, verify replicas that
failed, a stalled stream, the goodput decision made for it) and returns a `Route`: a verify replica, a draft
replica or none (target-only), the verify session to open there, and the K the draft service is sent.

The pools' own policies (affinity, prefix match, load bounds, health) are in `gateway.routing`; the router
combines them for one request, in this order:

- **Verify replica**: after a stall, the replica that holds the stalled stream's session (the target-only
  continuation resumes it there, cache included) while it is healthy; otherwise the session's replica by
  bounded-load consistent hashing, or for a request without a session the prefix-aware choice over the
  prompt and the tokens emitted so far. Replicas this generation found down are skipped.
- **Target-only**, straight on the verify replica: when the request asks it (K = 0); when it leaves K unset
  and more than `speculative_disable_by_batch_size` generations per healthy verify replica are in flight
  (vLLM's speculative_disable_by_batch_size), unless the request is greedy and the draft replica chooses its
  draft per round with suffix trees (it says so in its Info: a suffix proposal costs no draft forward, so it
  weighs each round against the verify batch itself); after a speculative stream stalled; without a healthy draft
  replica; or by the draft replicas' goodput reports (below).
- **Draft replica**: the least loaded healthy one, a replica that reports speculation loses last.
- **Goodput**: while the chosen draft replica last reported that speculation measures slower there than
  target-only steps, a request that leaves K and the seed unset goes "direct" (target-only on the verify
  replica, sparing the draft hop), every `goodput_probe_every`-th one a "probe" through the draft replica so
  that its guard measures speculation again, the interval doubling after each probe while the loss stands (up
  to PROBE_BACKOFF_MAX times); "draft" otherwise. One decision per request, kept across its
  failovers; a seeded request always keeps its path, so that it replays exactly; a greedy request to a replica
  with suffix trees keeps it too, so that the trees learn its output (its guard decides per session there).
  A sampled request is judged end to end too (`PathRates`, fed by the gateway as requests finish): direct
  while the draft path measures slower than the direct one at its load, whatever the replica reports.

The router knows nothing of streams or gRPC calls: the gateway's lifecycle (`gateway.core`) opens the
route's stream, watches it and fails over.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.routing import Pool, Replica
from specmesh.errors import Unavailable

if TYPE_CHECKING:
    from gateway.config import GatewayConfig

PROBE_BACKOFF_MAX = 8  # the longest wait between goodput probes of a standing loss, in --goodput-probe-every's


@dataclass(frozen=True)
class RouteRequest:
    """What one stream of a generation is routed by: the request, and what its generation went through."""

    session_id: str  # the request's session ("": none, so the prompt picks the verify replica)
    token_ids: list[int]  # the prompt and the tokens emitted so far
    k: int | None = None  # the request's K: None = the service's choice, 0 = target-only
    seeded: bool = False  # the request has a seed: it keeps the draft path, so that it replays exactly
    sampled: bool = False  # temperature > 0
    excluded: frozenset[str] | set[str] = frozenset()  # verify replicas this generation found down
    drafting: bool = True  # False once a speculative stream stalled: the rest is target-only
    goodput: str = ""  # the goodput decision already made for the request ("": none yet)
    # After a stall: the verify replica and the session the stalled stream held there (the last one opened).
    stalled_session: tuple[str, str] | None = None
    handed_off: bool = False  # a goodput probe handed back by its draft replica: the rest is target-only


class PathRates:
    """End-to-end tokens per second of the sampled requests the goodput routing sent each way, by the load
    they met (generations in flight at the gateway, by powers of two): "draft" (through a draft replica,
    probes included) and "direct" (target-only on the verify replica). A draft replica's guard compares its
    own sessions' speculative rounds with target-only steps taken through it, and so cannot see what its path
    costs a request end to end against the direct one: the hop on every verdict, a second session to open, a
    first round after the target's prefill. At one stream, T = 0.7, its guard measured speculation 4-40 %
    ahead while the draft path ran at 0.91-0.99x the direct one end to end, a third of the requests going
    that way. Each side keeps an exponentially decayed sum (`DECAY` per observation: about the last five
    requests), and counts once it has `MIN` requests."""

    DECAY = 0.8
    MIN = 2
    EDGES = (1, 2, 4, 8, 16, 32)

    def __init__(self) -> None:
        self._sums: dict[tuple[int, str], list[float]] = {}  # (load edge, side) -> [tokens, seconds, requests]

    @classmethod
    def bucket(cls, load: int) -> int:
        return max((e for e in cls.EDGES if e <= load), default=cls.EDGES[0])

    def observe(self, load: int, side: str, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0 or side not in ("draft", "direct"):
            return
        s = self._sums.setdefault((self.bucket(load), side), [0.0, 0.0, 0])
        s[0], s[1], s[2] = self.DECAY * s[0] + tokens, self.DECAY * s[1] + seconds, s[2] + 1

    def counted(self, load: int, side: str) -> bool:
        """Whether a side has its MIN requests at this load."""
        s = self._sums.get((self.bucket(load), side))
        return s is not None and s[2] >= self.MIN

    def rate(self, load: int, side: str) -> float | None:
        """Tokens per second of a side at this load, None until it has MIN requests."""
        s = self._sums.get((self.bucket(load), side))
        return s[0] / s[1] if s is not None and s[2] >= self.MIN and s[1] > 0 else None

    def draft_loses(self, load: int) -> bool | None:
        """Whether the draft path measures slower than the direct one at this load or, until both sides count
        here, at the nearest load where they do (the lower one on a tie); None where no load has both. A new
        level of load would otherwise spend its first requests measuring both paths (every other one direct,
        the rest through the draft, until each side has its MIN), whatever the levels around it measured."""
        here = self.EDGES.index(self.bucket(load))
        for edge in sorted(self.EDGES, key=lambda e: (abs(self.EDGES.index(e) - here), e)):
            draft, direct = self.rate(edge, "draft"), self.rate(edge, "direct")
            if draft is not None and direct is not None:
                return draft < direct
        return None


@dataclass(frozen=True)
class Route:
    """Where one stream goes."""

    verify: Replica
    draft: Replica | None  # None: target-only, straight on the verify replica
    session_id: str  # the verify session: the request's, or the stalled stream's when resumed on its replica
    k: int | None  # the K the draft service is sent; None leaves it unset (the draft service's default)
    goodput: str = ""  # "direct", "probe" or "draft": where the goodput reports sent the request ("" not asked)
    sampled: bool = False  # the request samples (T > 0): the draft replica's goodput report for its kind

    @property
    def target_only(self) -> bool:
        return self.draft is None

    @property
    def goodput_probe(self) -> bool:
        """Through a draft replica that reports speculation loses, so that it measures speculation again."""
        return self.goodput == "probe"


class Router:
    """The verify and draft pools, their health checks, and each stream's route (see the module docstring)."""

    def __init__(
        self,
        verify_pool: Pool,
        draft_pool: Pool,
        speculative_num_steps: int = 0,
        speculative_disable_by_batch_size: int = 0,
        goodput_probe_every: int = 8,
    ):
        self.verify_pool = verify_pool
        self.draft_pool = draft_pool
        self.speculative_num_steps = speculative_num_steps  # K of requests that leave it unset; 0: the service's
        self.speculative_disable_by_batch_size = speculative_disable_by_batch_size
        self.goodput_probe_every = goodput_probe_every
        self.target_only_fallbacks = 0  # streams routed target-only for want of a draft replica (or after a stall)
        self._tasks: list[asyncio.Task] = []
        self.path_rates = PathRates()  # sampled requests' end-to-end rates by path (fed by the gateway)
        self._sampled_drafted = 0  # sampled requests the goodput routing sent through a draft replica

    @classmethod
    def from_config(cls, config: GatewayConfig) -> Router:
        """The router of the gateway's replica pools, with its settings."""

        def pool(name: str, entries: tuple[str, ...]) -> Pool:
            return Pool(
                name,
                list(entries),
                load_factor=config.load_factor,
                fail_threshold=config.fail_threshold,
                success_threshold=config.success_threshold,
            )

        router = cls(
            pool("verify", config.verify),
            pool("draft", config.draft),
            speculative_num_steps=config.speculative_num_steps,
            speculative_disable_by_batch_size=config.speculative_disable_by_batch_size,
            goodput_probe_every=config.goodput_probe_every,
        )
        router.draft_pool.describe = router._describe_draft
        return router

    async def _describe_draft(self, replica: Replica) -> None:
        from specmesh.v1 import draft_pb2, draft_pb2_grpc

        stub = draft_pb2_grpc.DraftServiceStub(self.draft_pool.channel(replica))
        info = await stub.Info(draft_pb2.DraftServiceInfoRequest(), timeout=self.draft_pool.health_timeout)
        replica.suffix_decoding = info.suffix_decoding

    @property
    def pools(self) -> tuple[Pool, Pool]:
        return self.verify_pool, self.draft_pool

    async def start(self, health_interval_s: float) -> None:
        """Check every replica once, then keep checking them in the background."""
        for pool in self.pools:
            await pool.check_all()
            self._tasks.append(asyncio.get_running_loop().create_task(pool.run_health_checks(health_interval_s)))

    async def close(self) -> None:
        for t in self._tasks:
            t.cancel()
        for pool in self.pools:
            await pool.close()

    def route(self, ask: RouteRequest, inflight: int = 0) -> Route:
        """The route of the generation's next stream; `inflight`: the generations running at the gateway
        (this one included). Unavailable when no verify replica is healthy."""
        verify = self._stalled_on(ask) or (
            self.verify_pool.for_session(ask.session_id, ask.excluded)
            if ask.session_id
            else self.verify_pool.for_prompt(ask.token_ids, ask.excluded)
        )
        if verify is None:
            raise Unavailable("no healthy verify replica")
        session_id = ask.session_id
        if ask.stalled_session is not None and verify.address == ask.stalled_session[0]:
            session_id = ask.stalled_session[1]  # resumed on the stalled stream's replica
        k = ask.k if ask.k is not None else self.speculative_num_steps or None
        target_only = Route(verify, None, session_id, k, ask.goodput)
        if ask.k == 0:
            self.draft_pool.count("target_only_requested")  # the caller's choice, not a fallback
            return target_only
        draft = self.draft_pool.least_loaded(sampled=ask.sampled) if self.draft_pool.replicas and ask.drafting else None
        # A replica that drafts by suffix trees too weighs each round of a greedy request against the verify
        # batch itself. A sampled one accepts each proposed token with its probability only, which rarely pays
        # for the draft path's extra hop and first round (measured: 0.87-0.94x at 4-16 streams, T = 0.7).
        free = draft is not None and draft.suffix_decoding and not ask.sampled
        if ask.k is None and ask.drafting and not free and self._speculation_off_under_load(inflight):
            self.draft_pool.count("target_only_under_load")
            return target_only
        if draft is None:
            if self.draft_pool.replicas and not ask.handed_off:
                self.target_only_fallbacks += 1
            return target_only
        goodput = ask.goodput
        # Not a greedy request to a replica that drafts by suffix trees: its trees learn only the outputs of
        # generations it serves, and one sent past it would keep them as cold as when its guard measured a loss
        # (its guard still holds that request's session to target-only steps while speculation loses there).
        if ask.k is None and not ask.seeded and not free:
            goodput = goodput or self._goodput_route(draft, ask.sampled, inflight)  # once: a failover keeps it
            if goodput == "direct":
                return Route(verify, None, session_id, k, goodput)
        return Route(verify, draft, session_id, k, goodput, ask.sampled)

    def for_prompt(self, prompt_ids: list[int]) -> Replica:
        """The verify replica a prompt would be routed to (for a call about the prompt alone)."""
        verify = self.verify_pool.for_prompt(prompt_ids, set())
        if verify is None:
            raise Unavailable("no healthy verify replica")
        return verify

    def _stalled_on(self, ask: RouteRequest) -> Replica | None:
        """After a stall, the verify replica that holds the stalled stream's session, while it is healthy."""
        if ask.stalled_session is None:
            return None
        address, session = ask.stalled_session
        if not session or address in ask.excluded:
            return None
        replica = self.verify_pool.replicas.get(address)
        return replica if replica is not None and replica.healthy else None

    def _speculation_off_under_load(self, inflight: int) -> bool:
        """Whether the verify batch is past the size where speculation pays (--speculative-disable-by-batch-
        size): a batched target forward over N sessions' K + 1 positions costs ever more against N single
        positions as N grows, until drafting only adds work. Counted when the request is admitted (this one
        included), per healthy verify replica, so that requests arriving together see each other."""
        limit = self.speculative_disable_by_batch_size
        if limit <= 0:
            return False
        replicas = max(1, len(self.verify_pool.healthy))
        return inflight > limit * replicas

    def _goodput_route(self, draft: Replica, sampled: bool, inflight: int = 1) -> str:
        """Where a request that leaves K (and the seed) unset goes while `draft` last reported that
        speculation loses to target-only steps there for requests of its kind (`sampled` or greedy):
        "direct", target-only straight on the verify replica (through the draft service it would still pay
        the extra hop); every --goodput-probe-every-th one "probe", through the draft replica, which
        speculates on it so that its guard measures speculation again and can report that it pays; "draft"
        otherwise. A sampled request is judged end to end as well (`PathRates`, at the load it meets, or the
        nearest load measured until that one is): while
        the draft path measures slower than the direct one it goes direct (probes as above) whatever the
        replica reports, and while it goes through the draft, every --goodput-probe-every-th goes direct
        instead, so that the direct side stays measured (every other one until that side counts at the load:
        one in eight took 16 requests to judge)."""
        every = self.goodput_probe_every
        if every <= 0:
            return "draft"
        loses, why = draft.pays(sampled) is False, "target_only_by_goodput"
        if sampled and not loses:
            if not self.path_rates.draft_loses(inflight):
                self._probes_done(draft, sampled)
                self._sampled_drafted += 1
                # until the direct side counts at this load every other one measures it, then every N-th
                if self._sampled_drafted % (every if self.path_rates.counted(inflight, "direct") else 2) == 0:
                    self.draft_pool.count("target_only_measured")
                    return "direct"
                return "draft"
            loses, why = True, "target_only_end_to_end"
        if not loses:
            self._probes_done(draft, sampled)
            return "draft"
        wait = draft.probe_wait.get(sampled, every)
        if wait > 1:
            draft.probe_wait[sampled] = wait - 1
            self.draft_pool.count(why)
            return "direct"
        # Each probe that finds speculation still losing doubles the wait before the next: a probe pays its
        # measured rounds where speculation measured slower (at T = 0.7 on two shared cores a probe that also
        # relayed the rest of its steps took 1.2-1.7x a target-only request; handed back, it still pays the
        # rounds), so a standing loss is checked ever less often, down to one request in PROBE_BACKOFF_MAX x N.
        probes = draft.probes_losing.get(sampled, 0) + 1
        draft.probes_losing[sampled] = probes
        draft.probe_wait[sampled] = every * min(2**probes, PROBE_BACKOFF_MAX)
        return "probe"

    @staticmethod
    def _probes_done(draft: Replica, sampled: bool) -> None:
        """Speculation does not lose (any more) for this kind: the next loss probes at N again."""
        draft.probes_losing.pop(sampled, None)
        draft.probe_wait.pop(sampled, None)

"""Replica choice without a network: affinity, minimal movement when replicas join, load bounds, prefixes,
health thresholds, and the router's routes (target-only, K, a stalled stream's session)."""

import asyncio

import pytest

from gateway.router import Router, RouteRequest
from gateway.routing import Pool, prefix_blocks
from specmesh.errors import Unavailable


def pool(n, **kw):
    return Pool("verify", [f"10.0.0.{i}:50061" for i in range(n)], **kw)


def test_same_session_same_replica_and_few_move_when_one_joins():
    p = pool(4)
    sessions = [f"s{i}" for i in range(2000)]
    before = {s: p.for_session(s).address for s in sessions}
    assert all(p.for_session(s).address == before[s] for s in sessions)  # stable
    assert len(set(before.values())) == 4
    counts = {a: list(before.values()).count(a) for a in set(before.values())}
    assert max(counts.values()) < 2 * min(counts.values())  # virtual nodes spread sessions evenly
    p.add("10.0.0.9:50061")
    after = {s: p.for_session(s).address for s in sessions}
    moved = [s for s in sessions if after[s] != before[s]]
    assert all(after[s] == "10.0.0.9:50061" for s in moved)  # only to the new replica
    assert 0.1 < len(moved) / len(sessions) < 0.32  # about 1/5 of them


def test_load_bound_overflows_to_the_next_replica():
    p = pool(3, load_factor=1.25)
    home = p.for_session("hot")
    # pile in-flight load on the session's home replica: past the bound the session overflows
    home.inflight = 10
    other = p.for_session("hot")
    assert other is not home
    bound = p._bound()
    assert other.inflight < bound
    assert p.decisions["session_overflow"] >= 1
    home.inflight = 0
    assert p.for_session("hot") is home


def test_load_counting_never_exceeds_the_bound_in_a_burst():
    p = pool(4, load_factor=1.25)
    held = []
    for i in range(40):  # 40 concurrent sessions, none finishing
        r = p.for_session(f"burst-{i}")
        held.append(r.track())
        held[-1].__enter__()
        assert max(x.inflight for x in p.replicas.values()) <= p._bound()
    for h in held:
        h.__exit__(None, None, None)
    assert all(r.inflight == 0 for r in p.replicas.values())  # released on every exit


def test_prefix_aware_choice_for_requests_without_a_session():
    p = pool(3)
    system = list(range(100, 164))  # a shared 64-token system prompt
    first = p.for_prompt(system + [1, 2, 3])
    again = p.for_prompt(system + [7, 8, 9, 10])
    assert again is first and p.decisions["prefix_match"] == 1
    first.inflight = 50  # too loaded: the prefix is not worth the queue
    assert p.for_prompt(system + [5]) is not first
    assert prefix_blocks([1] * 15) == [] and len(prefix_blocks([1] * 32)) == 2


def test_health_thresholds():
    p = pool(2, fail_threshold=3, success_threshold=2)
    r = p.replicas["10.0.0.0:50061"]
    for _ in range(2):
        p._record(r, False)
    assert r.healthy
    p._record(r, False)
    assert not r.healthy and r not in p.healthy
    assert all(p.for_session(f"x{i}") is not r for i in range(50))
    p._record(r, True)
    assert not r.healthy
    p._record(r, True)
    assert r.healthy


def test_dns_names_expand_to_one_replica_per_address():
    p = Pool("verify", ["localhost:50061"])
    asyncio.run(p.refresh_membership())
    assert p.replicas and all(a.endswith(":50061") for a in p.replicas)
    assert all(not a.startswith("localhost") for a in p.replicas)


def router(**kw):
    return Router(pool(2), Pool("draft", ["10.0.1.1:50062"]), **kw)


def test_the_router_s_target_only_routes_and_its_k():
    r = router(speculative_num_steps=5, speculative_disable_by_batch_size=2)
    ask = RouteRequest("s", [1, 2, 3])
    route = r.route(ask, inflight=1)
    assert route.draft is not None and route.k == 5 and route.session_id == "s" and not route.target_only
    assert r.route(RouteRequest("s", [1, 2, 3], k=3)).k == 3  # the request's K wins
    assert r.route(RouteRequest("s", [1, 2, 3], k=0)).target_only  # asked for
    assert r.route(ask, inflight=5).target_only  # more than 2 per healthy verify replica in flight
    assert not r.route(RouteRequest("s", [1], k=2), inflight=5).target_only  # ... unless the request set K
    assert r.route(RouteRequest("s", [1], drafting=False)).target_only  # after a stall
    decisions = r.draft_pool.decisions
    assert decisions["target_only_requested"] == 1 and decisions["target_only_under_load"] == 1
    assert r.target_only_fallbacks == 1  # only the stall's: the others were no fallback
    r.verify_pool.replicas[route.verify.address].healthy = False
    r.verify_pool.replicas[next(a for a in r.verify_pool.replicas if a != route.verify.address)].healthy = False
    with pytest.raises(Unavailable):
        r.route(ask)


def test_a_stalled_stream_s_session_is_resumed_on_its_replica_while_it_is_healthy():
    r = router()
    home = r.route(RouteRequest("s", [1])).verify
    other = next(a for a in r.verify_pool.replicas if a != home.address)
    stalled = RouteRequest("s", [1], stalled_session=(other, "v-7"), drafting=False)
    route = r.route(stalled)
    assert route.verify.address == other and route.session_id == "v-7" and route.target_only
    r.verify_pool.replicas[other].healthy = False  # gone: back to the session's replica, with its own id
    route = r.route(stalled)
    assert route.verify is home and route.session_id == "s"


def test_past_the_batch_size_a_hybrid_draft_replica_gets_greedy_requests_only():
    """A draft replica that chooses its draft per round (suffix trees, Info.suffix_decoding) weighs a greedy
    request's rounds against the batch itself; a sampled request past the limit still decodes target-only."""
    r = router(speculative_num_steps=5, speculative_disable_by_batch_size=1)
    next(iter(r.draft_pool.replicas.values())).suffix_decoding = True
    assert not r.route(RouteRequest("s", [1, 2, 3]), inflight=5).target_only
    assert r.route(RouteRequest("s", [1, 2, 3], sampled=True), inflight=5).target_only
    assert r.draft_pool.decisions["target_only_under_load"] == 1

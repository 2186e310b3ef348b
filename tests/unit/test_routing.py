"""Replica choice without a network: affinity, minimal movement when replicas join, load bounds, prefixes,
health thresholds."""

import asyncio

from gateway.routing import Pool, prefix_blocks


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

"""The gateway's routing by the draft replicas' goodput reports, without a network: which draft replica,
straight to the verify replica or through the draft, one decision per request, and a replica that comes back
starts unmeasured."""

import asyncio

import pytest

from gateway.__main__ import parse_args
from gateway.config import GatewayConfig
from gateway.core import Gateway, GenRequest, Outcome
from gateway.router import PathRates
from specmesh.sampling import SamplingParams


def gateway(**kw) -> Gateway:
    return Gateway(GatewayConfig(verify=("10.0.0.1:50061",), draft=("10.0.1.1:50062", "10.0.1.2:50062"), **kw))


def choose(gw: Gateway, outcome: Outcome | None = None, **req):
    outcome = outcome or Outcome(prompt_tokens=3)
    params = req.pop("params", SamplingParams(temperature=0.0, max_tokens=4))
    route = gw._route(GenRequest([1, 2, 3], params, **req), [], set(), outcome)
    return route.draft, outcome


def test_a_replica_that_reports_speculation_loses_is_passed_over_for_one_that_pays():
    gw = gateway()
    a, b = gw.draft_pool.replicas.values()
    a.speculation_pays = False  # idle, so least loaded: it would win every choice on load alone
    for _ in range(5):
        draft, outcome = choose(gw)
        assert draft is b and outcome.goodput_route == "draft" and not outcome.target_only
    b.speculation_pays = False  # every replica says it loses: straight to the verify replica, 1 in 8 a probe
    routes = [choose(gw) for _ in range(16)]
    assert [o.goodput_route for _, o in routes] == ["direct"] * 7 + ["probe"] + ["direct"] * 8
    assert all((d is None) == o.target_only for d, o in routes)
    assert gw.draft_pool.decisions["target_only_by_goodput"] == 15
    # the caller's K, or a seed, keeps the draft path
    assert choose(gw, num_speculative_tokens=2)[0] is not None
    assert choose(gw, params=SamplingParams(temperature=0.7, max_tokens=4, seed=1))[0] is not None


def test_probes_of_a_standing_loss_come_ever_less_often_and_at_n_again_once_it_pays():
    """While the replica keeps reporting a loss, each probe doubles the wait before the next (8, 16, 32, then
    64 = PROBE_BACKOFF_MAX x 8 requests); once a report says speculation pays, a new loss probes at 8 again;
    greedy and sampled requests keep their own count."""
    from gateway.router import PROBE_BACKOFF_MAX

    gw = gateway()
    for r in gw.draft_pool.replicas.values():
        r.speculation_pays = r.speculation_pays_sampled = False

    def probes_at(n, **req):
        return [i for i in range(n) if choose(gw, **req)[1].goodput_route == "probe"]

    assert PROBE_BACKOFF_MAX == 8
    at = probes_at(8 + 16 + 32 + 64 + 64)
    assert at == [7, 7 + 16, 7 + 16 + 32, 7 + 16 + 32 + 64, 7 + 16 + 32 + 64 + 64]
    sampled = SamplingParams(temperature=0.7, max_tokens=4)
    assert probes_at(24, params=sampled) == [7, 23]  # the sampled kind's own count, from 8
    for r in gw.draft_pool.replicas.values():
        r.speculation_pays = True
    assert choose(gw)[1].goodput_route == "draft"
    for r in gw.draft_pool.replicas.values():
        r.speculation_pays = False
    assert probes_at(8) == [7]


def test_a_failover_keeps_the_request_s_goodput_decision():
    gw = gateway(goodput_probe_every=2)
    for r in gw.draft_pool.replicas.values():
        r.speculation_pays = False
    draft, outcome = choose(gw)
    assert outcome.goodput_route == "direct" and draft is None
    outcome.failovers += 1
    draft, outcome = choose(gw, outcome)  # chosen again after a failed replica: the same decision, counted once
    assert outcome.goodput_route == "direct" and draft is None
    assert gw.draft_pool.decisions["target_only_by_goodput"] == 1


def test_a_replica_back_in_the_pool_starts_unmeasured():
    gw = gateway(fail_threshold=1, success_threshold=1)
    a = next(iter(gw.draft_pool.replicas.values()))
    a.speculation_pays, a.probes_losing, a.probe_wait = False, {False: 3}, {False: 40}
    gw.draft_pool._record(a, False)
    assert not a.healthy and a.speculation_pays is False
    gw.draft_pool._record(a, True)  # maybe a restarted process, with a guard that has measured nothing
    assert a.healthy and a.speculation_pays is None
    assert a.probes_losing == {} and a.probe_wait == {}  # a loss it reports again probes at N


@pytest.mark.parametrize("every", ["1", "-1"])
def test_a_probe_share_that_would_not_probe_is_refused(every):
    with pytest.raises(SystemExit):
        parse_args(["--verify", "10.0.0.1:50061", "--goodput-probe-every", every])


def test_a_greedy_request_keeps_a_suffix_replica_that_reports_a_loss():
    """A replica with suffix trees learns only the outputs of generations it serves: a greedy request goes
    through it whatever its guard reported (the guard decides per session there), so that a repeated prompt
    finds its earlier output; a sampled one is still sent straight to the verify replica."""
    gw = gateway()
    for r in gw.draft_pool.replicas.values():
        r.speculation_pays = r.speculation_pays_sampled = False
        r.suffix_decoding = True
    routes = [choose(gw) for _ in range(8)]
    assert all(d is not None and not o.target_only for d, o in routes)
    assert "target_only_by_goodput" not in gw.draft_pool.decisions
    draft, outcome = choose(gw, params=SamplingParams(temperature=0.7, max_tokens=4))
    assert draft is None and outcome.goodput_route == "direct"


def test_greedy_and_sampled_requests_follow_their_own_kind_s_report():
    """A draft replica guards greedy and sampled generations apart, and each finished generation reports for
    its own kind: a loss measured on sampled requests sends sampled ones past the replica and leaves greedy
    ones on it, and the other way round."""
    gw = gateway(goodput_probe_every=1000)
    sampled = SamplingParams(temperature=0.7, max_tokens=4)
    for side, seconds in (("draft", 0.5), ("direct", 1.0)) * 2:  # sampled: both paths measured end to end
        gw.router.path_rates.observe(1, side, 64, seconds)
    for r in gw.draft_pool.replicas.values():
        r.report(True, False)
    assert all(choose(gw)[1].goodput_route == "draft" for _ in range(4))
    assert all(choose(gw, params=sampled)[1].goodput_route == "direct" for _ in range(4))
    for r in gw.draft_pool.replicas.values():
        r.report(True, True)
        r.report(False, False)
    assert all(choose(gw)[1].goodput_route == "direct" for _ in range(4))
    assert all(choose(gw, params=sampled)[1].goodput_route == "draft" for _ in range(4))


def test_a_replica_back_in_the_pool_has_neither_kind_measured():
    gw = gateway(fail_threshold=1, success_threshold=1)
    a = next(iter(gw.draft_pool.replicas.values()))
    a.report(False, False)
    a.report(True, False)
    gw.draft_pool._record(a, False)
    gw.draft_pool._record(a, True)
    assert a.pays(False) is None and a.pays(True) is None


def paced(monkeypatch, gw: Gateway, direct_s: float, draft_s: float):
    """Streams that take `direct_s` straight on the verify replica and `draft_s` through a draft, four tokens
    each; returns run(n, params), the goodput routes of n requests made one after another."""

    async def fake_stream(route, req, emitted, deadline, outcome):
        await asyncio.sleep(direct_s if route.draft is None else draft_s)
        yield [5, 6, 7, 8], "length", None

    monkeypatch.setattr(gw, "_stream", fake_stream)

    def run(n: int, params: SamplingParams) -> list[str]:
        async def requests() -> list[str]:
            routes = []
            for _ in range(n):
                outcome = Outcome(prompt_tokens=3)
                async for _chunk in gw.generate(GenRequest([1, 2, 3], params), outcome):
                    pass
                routes.append(outcome.goodput_route)
            return routes

        return asyncio.run(requests())

    return run


def test_path_rates_count_each_side_once_it_has_requests():
    rates = PathRates()
    assert rates.draft_loses(1) is None
    rates.observe(1, "draft", 64, 0.8)
    rates.observe(1, "direct", 64, 0.5)
    assert rates.rate(1, "draft") is None and rates.draft_loses(1) is None  # one request a side: not yet
    rates.observe(1, "draft", 64, 0.8)
    rates.observe(1, "direct", 64, 0.5)
    assert rates.rate(1, "draft") == pytest.approx(80.0) and rates.draft_loses(1) is True
    rates.observe(1, "", 64, 0.1)  # a request the goodput routing did not decide: not a side
    rates.observe(1, "direct", 0, 0.1)
    assert rates.rate(1, "direct") == pytest.approx(128.0)


def test_path_rates_judge_an_unmeasured_load_by_the_nearest_measured_one():
    rates = PathRates()
    for _ in range(2):
        rates.observe(1, "draft", 64, 0.8)
        rates.observe(1, "direct", 64, 0.5)
        rates.observe(16, "draft", 64, 0.2)
        rates.observe(16, "direct", 64, 0.5)
    assert rates.rate(4, "draft") is None  # each load is measured apart ...
    assert rates.draft_loses(2) is True and rates.draft_loses(8) is False  # ... and judged by the nearest
    assert rates.draft_loses(4) is True  # two levels from either: the lower one
    for _ in range(2):
        rates.observe(4, "draft", 64, 0.2)
        rates.observe(4, "direct", 64, 0.5)
    assert rates.draft_loses(4) is False and rates.draft_loses(2) is True  # its own verdict once both count


def test_sampled_requests_go_direct_while_the_draft_path_measures_slower_end_to_end(monkeypatch):
    """Neither replica reports a loss, but through a draft replica a sampled request takes 10x as long as
    straight on the verify replica: every other one goes direct until that side counts (two requests), and
    once both sides count, sampled requests go direct (every 4th of those a probe through the draft); while
    the draft path is not slower every 4th measures the direct side; greedy ones are not judged so."""
    gw = gateway(goodput_probe_every=4)
    sampled = SamplingParams(temperature=0.7, max_tokens=4)
    run = paced(monkeypatch, gw, direct_s=0.002, draft_s=0.02)
    assert run(4, sampled) == ["draft", "direct", "draft", "direct"]
    assert gw.draft_pool.decisions["target_only_measured"] == 2
    assert gw.router.path_rates.draft_loses(1) is True
    assert run(8, sampled) == ["direct"] * 3 + ["probe"] + ["direct"] * 4  # then 8 to the next: still slower
    assert gw.draft_pool.decisions["target_only_end_to_end"] == 7
    assert "target_only_by_goodput" not in gw.draft_pool.decisions
    assert run(4, SamplingParams(temperature=0.0, max_tokens=4)) == ["draft"] * 4


def test_while_the_draft_path_is_not_slower_every_nth_sampled_request_measures_the_direct_one(monkeypatch):
    gw = gateway(goodput_probe_every=4)
    run = paced(monkeypatch, gw, direct_s=0.02, draft_s=0.002)  # the draft path 10x as fast
    routes = run(12, SamplingParams(temperature=0.7, max_tokens=4))
    assert routes == ["draft", "direct", "draft", "direct"] + (["draft"] * 3 + ["direct"]) * 2
    assert gw.router.path_rates.draft_loses(1) is False

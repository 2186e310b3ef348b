"""vLLM's per-request speculative-decoding metrics (`metrics.speculative_decoding`) through the real services:
the object's shape on chat and completions, whole and streamed (the last chunk, with the usage), as AIPerf's
vLLM adapter reads and checks it, and its figures those of the response's own `specmesh` stats; the K cap a
request sets; a target-only request's zeros; null for n > 1; `detailed` adds each step, `none` leaves the
object out; the gRPC front's last message and the typed client carry the same numbers."""

import pytest
from specmesh_client import SpecmeshClient

from tests.support.rest import stream_with_usage
from tests.support.services import GatewayServer

SUMMARY_KEYS = {
    "num_spec_tokens",
    "num_spec_steps",
    "num_draft_tokens",
    "num_accepted_draft_tokens",
    "mean_acceptance_length",
    "draft_acceptance_rate",
    "acceptance_histogram",
    "acceptance_histogram_by_draft_length",
}
STEP_KEYS = {"per_step_accepted", "per_step_drafted"}
MESSAGES = [{"role": "user", "content": "Write a loop over a list."}]
PROMPT = "def parse(line):\n"


def check(spec: dict, specmesh: dict, detailed: bool = False) -> None:
    """The object as vLLM documents it and AIPerf's adapter checks it, its numbers those of `specmesh`."""
    assert set(spec) == SUMMARY_KEYS | (STEP_KEYS if detailed else set())
    k, hist = spec["num_spec_tokens"], spec["acceptance_histogram"]
    assert all(type(c) is int and c >= 0 for c in hist) and len(hist) == k + 1
    assert sum(hist) == spec["num_spec_steps"] == specmesh["drafts"]
    assert sum(j * c for j, c in enumerate(hist)) == spec["num_accepted_draft_tokens"] == specmesh["accepted"]
    assert spec["num_draft_tokens"] == specmesh["drafted"] >= spec["num_accepted_draft_tokens"]
    assert spec["mean_acceptance_length"] == pytest.approx(specmesh["mean_accepted_length"], abs=1e-4)
    assert spec["draft_acceptance_rate"] == pytest.approx(specmesh["acceptance_rate"], abs=1e-4)
    if spec["num_spec_steps"]:
        steps, accepted = spec["num_spec_steps"], spec["num_accepted_draft_tokens"]
        assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    rows = spec["acceptance_histogram_by_draft_length"]
    assert all(key.isdigit() and 0 < int(key) <= k and len(row) == int(key) + 1 for key, row in rows.items())
    assert [sum(row[j] for row in rows.values() if j < len(row)) for j in range(k + 1)] == hist
    if detailed:
        drafted, accepted_steps = spec["per_step_drafted"], spec["per_step_accepted"]
        assert len(drafted) == len(accepted_steps) == spec["num_spec_steps"]
        assert sum(drafted) == spec["num_draft_tokens"] and sum(accepted_steps) == spec["num_accepted_draft_tokens"]
        assert all(0 <= a <= d <= k for a, d in zip(accepted_steps, drafted, strict=True))


def spec_of(answer) -> tuple[dict, dict]:
    return answer.model_extra["metrics"]["speculative_decoding"], answer.model_extra["specmesh"]


@pytest.fixture(scope="module")
def client(demo_stack):
    return demo_stack.openai()


@pytest.fixture(scope="module")
def gateways(demo_stack, tokenizer):
    """Gateways at the other two levels, over the demo stack's replicas."""
    verify, draft = list(demo_stack.config.verify), list(demo_stack.config.draft)
    made = {
        level: GatewayServer(verify, draft, tokenizer, per_request_spec_decode_metrics=level)
        for level in ("detailed", "none")
    }
    yield made
    for gw in made.values():
        gw.stop()


@pytest.mark.parametrize("route", ["chat", "completions"])
@pytest.mark.parametrize("stream", [False, True])
def test_the_object_on_every_path(client, route, stream):
    kw = dict(model="demo", max_tokens=24, temperature=0)
    create = client.chat.completions.create if route == "chat" else client.completions.create
    kw |= dict(messages=MESSAGES) if route == "chat" else dict(prompt=PROMPT)
    if not stream:
        answer = create(**kw)
    else:
        chunks = list(stream_with_usage(create, **kw))
        assert all("metrics" not in c.model_extra for c in chunks[:-1])  # only the usage chunk carries it
        answer = chunks[-1]
        assert answer.usage is not None and not answer.choices
    spec, specmesh = spec_of(answer)
    check(spec, specmesh)
    assert spec["num_spec_steps"] > 0 and spec["num_spec_tokens"] >= 1  # the draft took part


def test_a_stream_without_usage_has_no_metrics(client):
    chunks = list(client.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, stream=True))
    assert all("metrics" not in c.model_extra for c in chunks)


def test_the_k_cap_a_request_sets_and_target_only_zeros(client):
    r = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"num_speculative_tokens": 3}
    )
    spec, specmesh = spec_of(r)
    check(spec, specmesh)
    assert spec["num_spec_tokens"] == 3 and len(spec["acceptance_histogram"]) == 4
    r = client.completions.create(
        model="demo", prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"num_speculative_tokens": 0}
    )
    spec, specmesh = spec_of(r)
    check(spec, specmesh)
    assert spec["acceptance_histogram"] == [0] and spec["num_spec_steps"] == spec["num_draft_tokens"] == 0
    assert spec["mean_acceptance_length"] == 1.0 and spec["acceptance_histogram_by_draft_length"] == {}


def test_null_for_several_choices(client):
    r = client.completions.create(model="demo", prompt=PROMPT, max_tokens=8, n=2, seed=1)
    assert r.model_extra["metrics"] == {"speculative_decoding": None}
    r = client.completions.create(model="demo", prompt=[PROMPT, "import os\n"], max_tokens=8, temperature=0)
    assert r.model_extra["metrics"] == {"speculative_decoding": None}


def test_detailed_adds_each_step_and_none_leaves_it_out(gateways):
    detailed = gateways["detailed"].openai()
    r = detailed.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=24, temperature=0)
    check(*spec_of(r), detailed=True)
    last = list(stream_with_usage(detailed.completions.create, model="demo", prompt=PROMPT, max_tokens=24))[-1]
    check(*spec_of(last), detailed=True)

    none = gateways["none"].openai()
    r = none.chat.completions.create(model="demo", messages=MESSAGES, max_tokens=8, temperature=0)
    assert "metrics" not in r.model_extra and r.model_extra["specmesh"]["drafts"] > 0
    last = list(stream_with_usage(none.completions.create, model="demo", prompt=PROMPT, max_tokens=8))[-1]
    assert "metrics" not in last.model_extra


def _as_dict(m) -> dict:
    """The typed client's metrics under the REST names (the map's keys as JSON writes them)."""
    out = {k: getattr(m, k) for k in SUMMARY_KEYS}
    out["acceptance_histogram"] = list(m.acceptance_histogram)
    out["acceptance_histogram_by_draft_length"] = {
        str(k): list(v) for k, v in m.acceptance_histogram_by_draft_length.items()
    }
    return out


def _stats(s) -> dict:
    return {
        "drafts": s.drafts,
        "accepted": s.accepted,
        "drafted": s.drafted,
        "mean_accepted_length": s.mean_accepted_length,
        "acceptance_rate": s.acceptance_rate,
    }


def test_the_grpc_front_and_the_typed_client_carry_the_same_numbers(demo_stack, gateways):
    with SpecmeshClient(demo_stack.grpc_address, model="demo") as c:
        whole = c.generate(messages=MESSAGES, max_tokens=24, temperature=0, num_speculative_tokens=3)
        last = list(c.generate_stream(PROMPT, max_tokens=24, temperature=0))[-1]
    for reply in (whole, last):
        m = reply.speculative_decoding
        assert m is not None and m.per_step_accepted == m.per_step_drafted == ()  # summary: no steps
        check(_as_dict(m), _stats(reply.stats))
        assert m.num_spec_steps > 0
    assert whole.speculative_decoding.num_spec_tokens == 3

    with SpecmeshClient(gateways["detailed"].grpc_address, model="demo") as c:
        m = c.generate(PROMPT, max_tokens=24, temperature=0).speculative_decoding
        assert len(m.per_step_drafted) == len(m.per_step_accepted) == m.num_spec_steps > 0
        assert sum(m.per_step_accepted) == m.num_accepted_draft_tokens
    with SpecmeshClient(gateways["none"].grpc_address, model="demo") as c:
        assert c.generate(PROMPT, max_tokens=8, temperature=0).speculative_decoding is None

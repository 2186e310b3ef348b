"""The model's whole context through the real services with their default flags: the verify service's KV in
blocks gives every session the demo target's 2,048 positions (`/v1/models` says so), and a request of a
1,800-token prompt (text no one here wrote: CPython's own source) + 200 new tokens is served speculatively
and equals the target's own greedy output token for token."""

import inspect

import pytest

from specmesh.models import load_model
from tests.support.models import ROOT, greedy_decoder
from tests.support.rest import http
from tests.support.services import GatewayServer, start_draft, start_verify


@pytest.fixture(scope="module")
def demo():
    """(target, tokenizer) of the demo pair, and the gateway over a verify service and a draft service on them,
    every flag at its default."""
    target, tokenizer = load_model(ROOT / "models" / "demo" / "target")
    draft, _ = load_model(ROOT / "models" / "demo" / "draft")
    verify = start_verify(target, tokenizer)
    draft_service = start_draft(draft, verify.address, tokenizer=tokenizer)
    gw = GatewayServer([verify.address], [draft_service.address], tokenizer)
    try:
        yield target, tokenizer, gw
    finally:
        gw.stop()
        draft_service.stop()
        verify.stop()


def long_prompt(tokenizer, n: int) -> list[int]:
    import asyncio.base_events as source  # a long standard-library module: public text

    ids = tokenizer(inspect.getsource(source), add_special_tokens=False)["input_ids"]
    assert len(ids) >= n
    return ids[:n]


def test_max_model_len_is_the_models_whole_context(demo):
    gw = demo[2]
    models = http("GET", gw.base_url + "/v1/models").json()
    assert models["data"][0]["max_model_len"] == 2048
    info = http("GET", gw.base_url + "/get_model_info").json()
    assert info["max_model_len"] == 2048


def test_a_prompt_of_1800_tokens_and_200_more_equals_target_only_greedy(demo):
    target, tokenizer, gw = demo
    prompt = long_prompt(tokenizer, 1800)
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": 200, "temperature": 0, "ignore_eos": True}}
    reply = http("POST", gw.base_url + "/generate", json_body=body)
    assert reply.status_code == 200, reply.json()
    out = reply.json()
    assert out["meta_info"]["prompt_tokens"] == 1800 and len(out["output_ids"]) == 200
    want = greedy_decoder(target, tokenizer)(prompt, 200, ignore_eos=True)
    assert out["output_ids"] == want.token_ids
    assert out["meta_info"]["spec_verify_ct"] < 200  # served speculatively: fewer rounds than tokens

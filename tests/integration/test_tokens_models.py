"""/tokenize, /detokenize, /version and the model card (/v1/models, /v1/models/{id}) over a real verify
service and gateway, in vLLM's shapes; bad input is a 400 that names the field, never a 500."""

import copy
import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

import specmesh
from specmesh.v1 import verify_pb2, verify_pb2_grpc
from tests.support.models import demo_target
from tests.support.services import GatewayServer, start_verify

TOO_LONG = "<a text longer than the gateway's longest prompt>"


def call(method: str, url: str, body=None, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def stack(tokenizer):
    # The verify service's context (512) is below the gateway's own limit (64 + 4096), so the card's
    # max_model_len shows it was asked of the replica.
    verify = start_verify(demo_target(tokenizer, seed=5), tokenizer, max_model_len=512)
    gw = GatewayServer([verify.address], [], tokenizer, max_prompt_tokens=64)
    info = verify_pb2_grpc.VerifyServiceStub(grpc.insecure_channel(verify.address)).Info(
        verify_pb2.VerifyServiceInfoRequest(), timeout=10
    )
    yield gw, info, verify
    gw.stop()
    verify.stop()


@pytest.fixture(scope="module")
def client(stack):
    return stack[0].openai()


def test_model_card_has_vllm_fields_from_the_verify_replicas(stack, client):
    _, info, _ = stack
    assert 0 < info.max_context_length <= 512
    listed = client.models.list().data
    assert [m.id for m in listed] == ["demo"]
    card = client.models.retrieve("demo")
    assert card.id == "demo" and card.object == "model" and card.owned_by == "specmesh"
    extra = card.model_extra
    assert extra["max_model_len"] == info.max_context_length
    assert extra["root"] == info.model_path == "(in-memory)"
    assert extra["parent"] is None
    (perm,) = extra["permission"]
    assert perm["object"] == "model_permission" and perm["allow_sampling"] is True
    assert listed[0].model_extra["max_model_len"] == info.max_context_length
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"


def test_version(stack):
    assert call("GET", stack[0].base_url + "/version") == (200, {"version": specmesh.__version__})


def test_tokenize_counts_what_completions_and_chat_feed_the_model(stack, client, tokenizer):
    gw, info, _ = stack
    prompt = "def fibonacci(n):\n    return"
    status, body = call("POST", gw.base_url + "/tokenize", {"model": "demo", "prompt": prompt})
    assert status == 200, body
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert body == {"count": len(ids), "max_model_len": info.max_context_length, "tokens": ids, "token_strs": None}
    done = client.completions.create(model="demo", prompt=prompt, max_tokens=1, temperature=0)
    assert done.usage.prompt_tokens == body["count"]

    status, strs = call("POST", gw.base_url + "/tokenize", {"prompt": prompt, "return_token_strs": True})
    assert status == 200 and strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)

    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    status, chat = call("POST", gw.base_url + "/tokenize", {"messages": messages})
    assert status == 200, chat
    reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=1, temperature=0)
    assert chat["count"] == reply.usage.prompt_tokens == len(chat["tokens"])
    # without the generation prompt: the same template, without the turn it opens for the reply
    status, bare = call("POST", gw.base_url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert status == 200
    assert bare["tokens"] == tokenizer("system: be brief\nuser: hi\n", add_special_tokens=False)["input_ids"]
    assert bare["count"] < chat["count"]


def test_detokenize_round_trips(stack, tokenizer):
    gw, _, _ = stack
    text = "class Node:\n    pass"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert call("POST", gw.base_url + "/detokenize", {"model": "demo", "tokens": ids}) == (200, {"prompt": text})
    assert call("POST", gw.base_url + "/detokenize", {"tokens": []}) == (200, {"prompt": ""})


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens[1]"),
        ("/detokenize", {"tokens": [8192]}, 400, "tokens[0]"),  # the vocabulary is 8192 ids
        ("/detokenize", {"tokens": [10**30]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [-(10**30)]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [1.0]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": ["7"]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": [[1]]}, 400, "tokens[0]"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {"tokens": {"0": 1}}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [0] * 5000}, 400, "tokens"),  # more than prompt + max_tokens limits (64 + 4096)
        ("/tokenize", {"prompt": 5}, 400, "prompt"),
        ("/tokenize", {"prompt": ["a"]}, 400, "prompt"),
        ("/tokenize", {}, 400, "prompt"),
        ("/tokenize", {"prompt": TOO_LONG}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
        ("/tokenize", {"prompt": "x", "return_token_strs": 1}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}, 400, "messages"),
        ("/tokenize", {"messages": []}, 400, "messages"),
        ("/tokenize", {"messages": "hi"}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
        ("/tokenize", {"messages": [{"role": "user", "content": 3}]}, 400, "messages[0].content"),
        ("/tokenize", {"messages": [{"role": "user", "content": TOO_LONG}]}, 400, "messages"),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "add_generation_prompt": 0}, 400, None),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": "x"}], "continue_final_message": True},
            400,
            "continue_final_message",
        ),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "tools": [{}]}, 400, "tools"),
        ("/tokenize", {"model": "other", "prompt": "x"}, 404, "model"),
        ("/tokenize", {"model": 5, "prompt": "x"}, 400, "model"),
        ("/detokenize", {"model": "other", "tokens": [1]}, 404, "model"),
    ],
)
def test_bad_input_is_refused_naming_the_field(stack, path, body, status, param):
    # more characters than max_prompt_tokens tokens can hold: refused before it is tokenized
    too_long = "x" * (stack[0].gateway.max_prompt_chars + 1)
    body = json.loads(json.dumps(body).replace(json.dumps(TOO_LONG), json.dumps(too_long)))
    got, answer = call("POST", stack[0].base_url + path, body)
    assert got == status, answer
    error = answer["error"]
    assert error["type"] in ("invalid_request_error", "not_found_error") and error["message"]
    if param is not None:
        assert error["param"] == param, error
    else:  # the field is named in the message
        assert "add_generation_prompt" in (error["param"] or "") + error["message"], error


@pytest.mark.parametrize(
    "raw",
    [
        b'{"tokens": [' + b"9" * 5000 + b"]}",  # past Python's int() digit limit: a ValueError, not a JSONDecodeError
        b"not json",
        b"[1, 2]",
        b'{"tokens": [1]',
    ],
)
def test_malformed_bodies_are_400(stack, raw):
    for path in ("/tokenize", "/detokenize"):
        got, answer = call("POST", stack[0].base_url + path, raw=raw)
        assert got == 400 and answer["error"]["code"] == "invalid_json", answer


def test_chat_template_with_and_without_the_generation_prompt(stack, tokenizer):
    """With a tokenizer that has a chat template (the demo's, given one): the count is what chat feeds the
    model, and without the generation prompt it is the template's own rendering without it."""
    templated = copy.deepcopy(tokenizer)
    templated.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    gw = GatewayServer([stack[2].address], [], templated)
    try:
        messages = [{"role": "user", "content": "hello there"}]
        status, full = call("POST", gw.base_url + "/tokenize", {"model": "demo", "messages": messages})
        assert status == 200, full
        client = gw.openai()
        reply = client.chat.completions.create(model="demo", messages=messages, max_tokens=1, temperature=0)
        assert full["count"] == reply.usage.prompt_tokens
        status, bare = call("POST", gw.base_url + "/tokenize", {"messages": messages, "add_generation_prompt": False})
        assert status == 200
        want = templated.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        assert bare["tokens"] == list(want["input_ids"] if hasattr(want, "keys") else want)
        assert bare["count"] < full["count"]
    finally:
        gw.stop()


def test_model_card_without_a_verify_replica_answering(tokenizer):
    """No verify replica answers Info: the card says what the gateway itself admits, and names the model."""
    gw = GatewayServer(["127.0.0.1:1"], [], tokenizer, max_prompt_tokens=100, max_tokens_limit=20)
    try:
        status, card = call("GET", gw.base_url + "/v1/models/demo")
        assert status == 200, card
        assert card["max_model_len"] == 120 and card["root"] == "demo"
        status, counted = call("POST", gw.base_url + "/tokenize", {"prompt": "abc"})
        assert status == 200 and counted["max_model_len"] == 120
    finally:
        gw.stop()


def test_no_tokenizer_is_a_400_not_a_500():
    gw = GatewayServer(["127.0.0.1:1"], [], None)
    try:
        for path, body in (("/tokenize", {"prompt": "abc"}), ("/detokenize", {"tokens": [1]})):
            status, answer = call("POST", gw.base_url + path, body)
            assert status == 400 and "no tokenizer" in answer["error"]["message"], answer
    finally:
        gw.stop()

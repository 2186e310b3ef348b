"""SGLang's native API on the gateway (`/generate` and the service routes) over real services on loopback:
answers checked against the target model itself (greedy output, log-probabilities from its own forward),
SGLang's streaming format, and a table of bad inputs that must each be a 400 naming the parameter."""

import itertools
import json
import math
import re
import urllib.error
import urllib.request

import pytest
import torch

from tests.support.models import noisy_copy, target_log_softmax
from tests.support.services import GatewayServer, free_port, start_draft, start_verify

PROMPT = "def add(a, b):\n"


def call(method: str, url: str, body=None, raw: bytes | None = None, key: str | None = None) -> tuple[int, str, str]:
    """(status, content type, body text) of one plain HTTP call."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    headers = {"content-type": "application/json"} | ({"authorization": f"Bearer {key}"} if key else {})
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.headers.get("content-type", ""), r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get("content-type", ""), e.read().decode()


def events(text: str) -> list:
    """The JSON events of an SSE body, checked to end with exactly one `data: [DONE]`."""
    lines = [line for line in text.split("\n\n") if line]
    assert lines[-1] == "data: [DONE]" and lines.count("data: [DONE]") == 1
    return [json.loads(line.removeprefix("data: ")) for line in lines[:-1]]


@pytest.fixture(scope="module")
def services(target, tokenizer):
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    yield [verify.address], [draft.address]
    draft.stop()
    verify.stop()


@pytest.fixture(scope="module")
def url(services, tokenizer):
    gw = GatewayServer(*services, tokenizer, max_prompt_tokens=512, max_tokens_limit=256)
    yield gw.base_url
    gw.stop()


def generate(url: str, body: dict):
    status, _, text = call("POST", url + "/generate", body)
    assert status == 200, text
    return json.loads(text)


def test_generate_is_the_targets_greedy_output_with_sglang_meta_info(url, tokenizer, greedy):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    want = greedy(ids, 12, ignore_eos=True)
    out = generate(
        url, {"text": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}}
    )
    assert out["output_ids"] == want.token_ids
    assert out["text"] == tokenizer.decode(want.token_ids, skip_special_tokens=True)
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert (meta["prompt_tokens"], meta["completion_tokens"]) == (len(ids), 12)
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str) and meta["id"]
    stats = meta["specmesh"]
    assert meta["spec_verify_ct"] == stats["rounds"] >= 1
    assert (meta["spec_num_proposed_drafts"], meta["spec_num_correct_drafts"]) == (stats["drafted"], stats["accepted"])
    assert stats["drafted"] > 0  # the draft service took part
    assert meta["spec_accept_rate"] == pytest.approx(stats["accepted"] / stats["drafted"], abs=1e-5)
    assert meta["spec_accept_length"] == pytest.approx(12 / stats["rounds"], abs=1e-5)

    # A session's next turn reuses its cached prompt.
    turn = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = generate(url, {"input_ids": ids, "session_id": "chat-1", "sampling_params": turn})
    more = ids + first["output_ids"] + tokenizer("  return a\n", add_special_tokens=False)["input_ids"]
    second = generate(url, {"input_ids": more, "session_id": "chat-1", "sampling_params": turn})
    assert second["meta_info"]["cached_tokens"] >= len(ids)

    # The same prompt as input_ids, and the rid named by the caller.
    again = generate(
        url,
        {
            "input_ids": ids,
            "rid": "mine",
            "sampling_params": {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True},
        },
    )
    assert again["output_ids"] == want.token_ids and again["meta_info"]["id"] == "mine"


def test_batch_and_n_answer_a_list_in_sglang_order(url, tokenizer, greedy):
    prompts = ["import os\n", "class A:\n"]
    body = {"text": prompts, "sampling_params": {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True, "n": 2}}
    out = generate(url, body)
    assert len(out) == 4
    for i, prompt in enumerate(prompts):
        want = greedy(tokenizer(prompt, add_special_tokens=False)["input_ids"], 5, ignore_eos=True).token_ids
        assert out[2 * i]["output_ids"] == out[2 * i + 1]["output_ids"] == want
    assert len({o["meta_info"]["id"] for o in out}) == 4

    # One sampling_params object per prompt.
    per = generate(
        url,
        {
            "text": prompts,
            "sampling_params": [{"max_new_tokens": 2, "temperature": 0}, {"max_new_tokens": 3, "temperature": 0}],
        },
    )
    assert [o["meta_info"]["completion_tokens"] for o in per] == [2, 3]


def test_stream_sends_cumulative_text_and_meta_info_then_done(url):
    body = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True},
    }
    status, ctype, text = call("POST", url + "/generate", body)
    assert status == 200 and ctype.startswith("text/event-stream")
    evs = events(text)
    whole = generate(url, {**body, "stream": False})
    assert len(evs) >= 2
    for a, b in itertools.pairwise(evs):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    assert (evs[-1]["text"], evs[-1]["output_ids"]) == (whole["text"], whole["output_ids"])
    assert evs[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
    assert evs[-1]["meta_info"]["spec_verify_ct"] >= 1 and "index" not in evs[-1]

    # A batch's events carry their generation's index; each generation's last event is its whole answer.
    batch = {
        "text": ["import os\n", PROMPT],
        "stream": True,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
    }
    evs = events(call("POST", url + "/generate", batch)[2])
    assert {e["index"] for e in evs} == {0, 1}
    whole = generate(url, {**batch, "stream": False})
    for i in (0, 1):
        last = [e for e in evs if e["index"] == i][-1]
        assert last["output_ids"] == whole[i]["output_ids"] and last["meta_info"]["finish_reason"] is not None


def test_stop_strings_and_stop_token_ids_report_what_matched(url, tokenizer, greedy):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    full = greedy(ids, 12, ignore_eos=True)
    stop_id = full.token_ids[3]
    out = generate(
        url,
        {"input_ids": ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": [stop_id]}},
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert out["output_ids"][-1] == stop_id and len(out["output_ids"]) == full.token_ids.index(stop_id) + 1
    assert out["text"] == tokenizer.decode(out["output_ids"][:-1], skip_special_tokens=True)  # not the stop token's

    text = tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    out = generate(
        url,
        {
            "input_ids": ids,
            "sampling_params": {
                "max_new_tokens": 12,
                "temperature": 0,
                "stop": [stop, "never here"],
                "ignore_eos": True,
            },
        },
    )
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]


def test_logprobs_are_the_targets_in_sglang_shape(url, target, tokenizer):
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    body = {
        "input_ids": ids,
        "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "logprob_start_len": 0,
        "top_logprobs_num": 3,
        "return_text_in_logprobs": True,
    }
    meta = generate(url, body)["meta_info"]
    out_ids = [e[1] for e in meta["output_token_logprobs"]]
    ref = target_log_softmax(target, ids + out_ids)
    prompt = meta["input_token_logprobs"]
    assert [e[1] for e in prompt] == ids and prompt[0][0] is None and meta["input_top_logprobs"][0] is None
    for p in range(1, len(ids)):
        assert prompt[p][0] == pytest.approx(ref[p - 1, ids[p]].item(), abs=1e-4)
        assert prompt[p][2] == tokenizer.decode([ids[p]])
        top = meta["input_top_logprobs"][p]
        want = torch.topk(ref[p - 1], 3)
        assert [t[1] for t in top] == want.indices.tolist()
        assert [t[0] for t in top] == pytest.approx(want.values.tolist(), abs=1e-4)
    for j, (lp, tid, txt) in enumerate(meta["output_token_logprobs"]):
        row = ref[len(ids) - 1 + j]
        assert tid == int(row.argmax()) and lp == pytest.approx(row[tid].item(), abs=1e-4)
        assert txt == tokenizer.decode([tid])
        assert meta["output_top_logprobs"][j][0][1] == tid

    # From logprob_start_len on, and without text; max_new_tokens 0 scores the prompt only (what select uses).
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": 2}
    out = generate(url, body)
    assert out["text"] == "" and out["output_ids"] == [] and out["meta_info"]["output_token_logprobs"] == []
    assert [e[1] for e in out["meta_info"]["input_token_logprobs"]] == ids[2:]
    assert out["meta_info"]["input_token_logprobs"][0][0] == pytest.approx(prompt[2][0], abs=1e-5)
    assert all(e[2] is None for e in out["meta_info"]["input_token_logprobs"])
    assert "input_top_logprobs" not in out["meta_info"]
    # Per prompt of a batch, even for two equal prompts.
    both = generate(
        url, {"text": ["a b", "a b"], "return_logprob": [True, False], "sampling_params": {"max_new_tokens": 1}}
    )
    assert "output_token_logprobs" in both[0]["meta_info"] and "output_token_logprobs" not in both[1]["meta_info"]
    # Default logprob_start_len (-1): the output's only.
    meta = generate(url, {**body, "sampling_params": {"max_new_tokens": 2, "temperature": 0}, "logprob_start_len": -1})[
        "meta_info"
    ]
    assert meta["input_token_logprobs"] == [] and len(meta["output_token_logprobs"]) == 2
    assert all(math.isfinite(e[0]) for e in meta["output_token_logprobs"])


def test_sampling_parameters_are_honoured(url, tokenizer, greedy):
    # A prompt whose greedy continuation repeats a token, so that the penalties change it.
    rep = tokenizer("x = x + x + x + x", add_special_tokens=False)["input_ids"]
    penalties = {"frequency_penalty": 2.0, "repetition_penalty": 1.3}
    sp = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, **penalties}
    want = greedy(rep, 24, ignore_eos=True, **penalties).token_ids
    assert generate(url, {"input_ids": rep, "sampling_params": sp})["output_ids"] == want
    assert want != greedy(rep, 24, ignore_eos=True).token_ids  # the penalties did change the output
    ids = tokenizer(PROMPT, add_special_tokens=False)["input_ids"]
    # A seeded sample replays exactly; min_new_tokens holds back the stop tokens.
    seeded = {"max_new_tokens": 8, "temperature": 0.8, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "sampling_seed": 7}
    a, b = (generate(url, {"input_ids": ids, "sampling_params": seeded})["output_ids"] for _ in range(2))
    assert a == b
    first = greedy(ids, 1).token_ids[0]
    out = generate(
        url,
        {
            "input_ids": ids,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0, "stop_token_ids": [first], "min_new_tokens": 2},
        },
    )
    assert out["meta_info"]["completion_tokens"] >= 2 and out["output_ids"][0] != first


def test_regex_and_json_schema_constrain_the_output(url, tokenizer):
    # The output matches the grammar, then ends (the last token is the model's EOS, which the grammar
    # allows once it is satisfied; this tiny model's EOS is an ordinary token of the demo tokenizer).
    out = generate(
        url, {"text": "x = ", "sampling_params": {"max_new_tokens": 8, "temperature": 0, "regex": "[0-9]{3}"}}
    )
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch("[0-9]{3}", tokenizer.decode(out["output_ids"][:-1]))
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"], "additionalProperties": False}
    sp = {"max_new_tokens": 30, "temperature": 0.9, "sampling_seed": 3, "json_schema": json.dumps(schema)}
    out = generate(url, {"text": "x = ", "sampling_params": sp})
    assert json.loads(tokenizer.decode(out["output_ids"][:-1]))["a"] in (1, 2)
    # A grammar the engine cannot build is a 400, before any output.
    for stream in (False, True):
        body = {"text": "x = ", "stream": stream, "sampling_params": {"regex": "[0-9"}}
        status, _, text = call("POST", url + "/generate", body)
        assert status == 400 and "regex" in json.loads(text)["error"]["message"], text


def test_skip_special_tokens_false_keeps_them_in_the_text(url, tokenizer):
    eos = tokenizer.eos_token_id
    special = tokenizer.decode([eos])
    assert special and tokenizer.decode([eos], skip_special_tokens=True) == ""
    # The bias makes every token the EOS token; ignore_eos lets them through as output.
    sp = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {str(eos): 100}}
    kept = generate(url, {"text": PROMPT, "sampling_params": {**sp, "skip_special_tokens": False}})
    assert kept["output_ids"] == [eos] * 3 and kept["text"] == special * 3
    assert generate(url, {"text": PROMPT, "sampling_params": sp})["text"] == ""
    evs = events(
        call(
            "POST",
            url + "/generate",
            {"text": PROMPT, "stream": True, "sampling_params": {**sp, "skip_special_tokens": False}},
        )[2]
    )
    assert evs[-1]["text"] == special * 3 and all(b["text"].startswith(a["text"]) for a, b in itertools.pairwise(evs))
    # The token that ends an output (a stop token, or the EOS) is not part of its text, as in SGLang.
    sp = {"max_new_tokens": 3, "temperature": 0, "logit_bias": {str(eos): 100}, "stop_token_ids": [eos]}
    sp["skip_special_tokens"] = False
    ended = generate(url, {"text": PROMPT, "sampling_params": sp})
    assert ended["output_ids"] == [eos] and ended["text"] == ""
    assert ended["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}


def test_service_routes(url):
    for path in ("/get_model_info", "/model_info"):
        status, _, text = call("GET", url + path)
        assert status == 200 and json.loads(text)["model_path"] == "demo" and json.loads(text)["is_generation"]
    for path in ("/server_info", "/get_server_info"):
        status, _, text = call("GET", url + path)
        info = json.loads(text)
        assert status == 200 and info["served_model_name"] == "demo" and len(info["verify_replicas"]) == 1
        assert info["internal_states"][0]["avg_spec_accept_length"] >= 1.0
    for method in ("GET", "POST"):
        status, _, text = call(method, url + "/flush_cache")
        assert status == 200 and "session" in text
        assert call(method, url + "/flush_cache?timeout=1.5")[0] == 200
        for bad in ("abc", "-1", "nan", "inf"):
            status, _, text = call(method, url + f"/flush_cache?timeout={bad}")
            assert status == 400 and json.loads(text)["error"]["param"] == "timeout", text
    assert call("GET", url + "/health_generate")[0] == 200
    assert call("GET", url + "/generate")[0] == 405


def test_with_api_keys_every_route_needs_one(services, tokenizer):
    gw = GatewayServer(*services, tokenizer, api_keys=("k1",))
    try:
        body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 2}}
        for method, path, payload in [("POST", "/generate", body), ("GET", "/get_model_info", None)]:
            status, _, text = call(method, gw.base_url + path, payload)
            assert status == 401 and json.loads(text)["error"]["message"], text
            assert call(method, gw.base_url + path, payload, key="k2")[0] == 401
            assert call(method, gw.base_url + path, payload, key="k1")[0] == 200
    finally:
        gw.stop()


def test_without_a_healthy_verify_replica_generate_is_a_503_and_health_generate_fails(tokenizer):
    gw = GatewayServer([f"127.0.0.1:{free_port()}"], [], tokenizer)  # nothing listens there
    try:
        for stream in (False, True):
            status, _, text = call("POST", gw.base_url + "/generate", {"text": PROMPT, "stream": stream})
            assert status == 503 and json.loads(text)["error"]["message"], text
        assert call("GET", gw.base_url + "/health_generate")[0] == 503
    finally:
        gw.stop()


# (body, the parameter the 400 must name; None: a message without a parameter)
BAD = [
    ({}, "text"),
    ({"text": ""}, "text"),
    ({"text": 5}, "text"),
    ({"text": []}, "text"),
    ({"text": ["a", ""]}, "text[1]"),
    ({"text": ["a", 3]}, "text"),
    ({"text": "a", "input_ids": [1]}, "text"),
    ({"input_ids": []}, "input_ids"),
    ({"input_ids": [-1]}, "input_ids[0]"),
    ({"input_ids": [10**9]}, "input_ids[0]"),
    ({"input_ids": [1.5]}, "input_ids"),
    ({"input_ids": [[1], [True]]}, "input_ids[1]"),
    ({"input_ids": [1] * 600}, None),  # longer than max_prompt_tokens
    ({"input_ids": [1] * 600, "sampling_params": {"max_new_tokens": 0}}, None),
    ({"text": "a", "sampling_params": 3}, "sampling_params"),
    ({"text": "a", "sampling_params": {"max_new_tokens": -1}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": "5"}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": True}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 10**30}}, "sampling_params.max_new_tokens"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 300}}, None),  # over max_tokens_limit
    ({"text": "a", "sampling_params": {"temperature": -1}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"temperature": "hot"}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"top_p": 1.5}}, "sampling_params.top_p"),
    ({"text": "a", "sampling_params": {"top_k": -2}}, "sampling_params.top_k"),
    ({"text": "a", "sampling_params": {"top_k": 2.5}}, "sampling_params.top_k"),
    ({"text": "a", "sampling_params": {"min_p": 2}}, "sampling_params.min_p"),
    ({"text": "a", "sampling_params": {"stop": [""]}}, "sampling_params.stop"),
    ({"text": "a", "sampling_params": {"stop": 5}}, "sampling_params.stop"),
    ({"text": "a", "sampling_params": {"stop": ["x"] * 17}}, "sampling_params.stop"),
    ({"text": "a", "sampling_params": {"stop_token_ids": [-1]}}, "sampling_params.stop_token_ids[0]"),
    ({"text": "a", "sampling_params": {"stop_token_ids": "a"}}, "sampling_params.stop_token_ids"),
    ({"text": "a", "sampling_params": {"ignore_eos": "yes"}}, "sampling_params.ignore_eos"),
    ({"text": "a", "sampling_params": {"skip_special_tokens": "no"}}, "sampling_params.skip_special_tokens"),
    (
        {"text": "a", "sampling_params": {"spaces_between_special_tokens": 0}},
        "sampling_params.spaces_between_special_tokens",
    ),
    ({"text": "a", "sampling_params": {"n": 0}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"n": 17}}, "sampling_params.n"),
    ({"text": "a", "sampling_params": {"frequency_penalty": 3}}, "sampling_params.frequency_penalty"),
    ({"text": "a", "sampling_params": {"presence_penalty": -2.5}}, "sampling_params.presence_penalty"),
    ({"text": "a", "sampling_params": {"repetition_penalty": 0}}, "sampling_params.repetition_penalty"),
    ({"text": "a", "sampling_params": {"max_new_tokens": 2, "min_new_tokens": 5}}, "sampling_params.min_new_tokens"),
    ({"text": "a", "sampling_params": {"regex": 5}}, "sampling_params.regex"),
    ({"text": "a", "sampling_params": {"json_schema": ""}}, "sampling_params.json_schema"),
    ({"text": "a", "sampling_params": {"regex": "a", "json_schema": "{}"}}, "sampling_params.json_schema"),
    ({"text": "a", "sampling_params": {"json_schema": "{not json"}}, None),
    ({"text": "a", "sampling_params": {"ebnf": "root ::= 'a'"}}, "sampling_params.ebnf"),
    ({"text": "a", "sampling_params": {"stop_regex": ["a"]}}, "sampling_params.stop_regex"),
    ({"text": "a", "sampling_params": {"no_stop_trim": True}}, "sampling_params.no_stop_trim"),
    ({"text": "a", "sampling_params": {"stream_interval": 4}}, "sampling_params.stream_interval"),
    ({"text": "a", "sampling_params": {"bogus": 1}}, "sampling_params.bogus"),
    ({"text": "a", "sampling_params": {"logit_bias": {"x": 1}}}, "sampling_params.logit_bias"),
    ({"text": "a", "sampling_params": {"logit_bias": {"1": 500}}}, "sampling_params.logit_bias.1"),
    ({"text": "a", "sampling_params": {"logit_bias": {"9" * 5000: 1}}}, "sampling_params.logit_bias"),
    ({"text": "a", "sampling_params": {"logit_bias": {"²": 1}}}, "sampling_params.logit_bias"),
    ({"text": "a", "sampling_params": {"temperature": 10**400}}, "sampling_params.temperature"),
    ({"text": "a", "sampling_params": {"top_k": 10**400}}, "sampling_params.top_k"),
    ({"text": ["a", "b"], "sampling_params": [{}, 3]}, "sampling_params[1]"),
    ({"text": "a", "sampling_params": {"sampling_seed": -1}}, "sampling_params.sampling_seed"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params"),
    ({"text": ["a", "b"], "sampling_params": [{}, {"top_p": 2}]}, "sampling_params[1].top_p"),
    ({"text": ["a", "b"], "sampling_params": [{"n": 1}, {"n": 2}]}, "sampling_params"),
    ({"text": ["a"] * 5, "sampling_params": {"n": 16}}, "text"),
    ({"text": "a", "image_data": "x.png"}, "image_data"),
    ({"text": "a", "lora_path": "adapter"}, "lora_path"),
    ({"text": "a", "return_hidden_states": True}, "return_hidden_states"),
    ({"text": "a", "token_ids_logprob": [1]}, "token_ids_logprob"),
    ({"text": "a", "bogus": 1}, "bogus"),
    ({"text": "a", "return_logprob": "yes"}, "return_logprob"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": -2}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "logprob_start_len": 50}, "logprob_start_len"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start_len"),
    ({"text": "a", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num"),
    ({"text": ["a", "b"], "return_logprob": [True]}, "return_logprob"),
    ({"text": "a", "return_text_in_logprobs": 1}, "return_text_in_logprobs"),
    ({"text": "a", "rid": 5}, "rid"),
    ({"text": "a", "stream": "true"}, "stream"),
    ({"text": "a", "stream": 0}, "stream"),
    ({"text": "a", "return_text_in_logprobs": 0}, "return_text_in_logprobs"),
    ({"text": "a", "log_metrics": "no"}, "log_metrics"),
    ({"text": "a", "session_id": 0}, "session_id"),
    ({"text": ["a", "b"], "session_id": "s"}, "session_id"),
    ({"text": "a", "session_id": 5}, "session_id"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[str(i) for i in range(len(BAD))])
def test_bad_input_is_a_400_naming_the_parameter(url, body, param):
    status, _, text = call("POST", url + "/generate", body)
    assert status == 400, text
    error = json.loads(text)["error"]
    assert error["message"]
    if param is not None:
        assert error["param"] == param, error


@pytest.mark.parametrize(
    "raw", [b"{", b"[1, 2]", b'"text"', b"\xff", b'{"text": "a", "sampling_params": {"top_p": NaN}}']
)
def test_a_body_that_is_not_a_json_object_is_a_400(url, raw):
    status, _, text = call("POST", url + "/generate", raw=raw)
    assert status == 400 and json.loads(text)["error"]["message"], text

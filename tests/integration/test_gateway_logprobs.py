"""The REST front's log-probabilities, echo, n > 1, lists of prompts and vLLM's sampling extras, through real
services with the official openai client."""

import grpc
import openai
import pytest
import torch

from specmesh import wire
from specmesh.sampling import SamplingParams
from specmesh.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.support.laws import LAW_PROMPT, LAW_VOCAB, first_two_counts, law_target, pooled_chisquare, sampling_services
from tests.support.models import target_log_softmax

TOL = 2e-3  # the services' batched forward against a plain HF forward, fp32


@pytest.fixture(scope="module")
def client(demo_stack):
    return demo_stack.openai()


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_completion_logprobs_are_the_target_log_softmax(client, target, tokenizer, greedy):
    prompt = "def parse(text):\n"
    ids = ids_of(tokenizer, prompt)
    want = greedy(ids, 12).token_ids
    rows = target_log_softmax(target, ids + want)[len(ids) - 1 : -1]
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.tokens == [tokenizer.decode([t]) for t in want]
    for i, t in enumerate(want):
        assert abs(lp.token_logprobs[i] - rows[i, t].item()) < TOL
        top = rows[i].topk(3)
        expected = {tokenizer.decode([int(j)]): v for j, v in zip(top.indices, top.values.tolist(), strict=True)}
        assert lp.top_logprobs[i].keys() == expected.keys()
        assert all(abs(lp.top_logprobs[i][k] - v) < TOL for k, v in expected.items())
    assert lp.text_offset == [sum(len(x) for x in lp.tokens[:i]) for i in range(12)]
    # target-only decoding (the verify service's own Generate) carries the same log-probabilities
    r0 = client.completions.create(
        model="demo", prompt=prompt, max_tokens=12, temperature=0, logprobs=3, extra_body={"num_speculative_tokens": 0}
    )
    assert r0.choices[0].logprobs.tokens == lp.tokens
    assert all(abs(a - b) < TOL for a, b in zip(r0.choices[0].logprobs.token_logprobs, lp.token_logprobs, strict=True))
    # sampled: each value is the raw log-softmax of an id with that text, at its position
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=8, temperature=1.0, seed=3, logprobs=0)
    text_of = [tokenizer.decode([t]) for t in range(len(tokenizer))]
    emitted: list[int] = []
    for tok, val in zip(r.choices[0].logprobs.tokens, r.choices[0].logprobs.token_logprobs, strict=True):
        row = target_log_softmax(target, ids + emitted)[-1]
        match = [t for t, x in enumerate(text_of) if x == tok and abs(row[t].item() - val) < TOL]
        assert match, tok
        emitted.append(match[0])


def test_chat_logprobs_whole_and_streamed(client, demo_stack, target):
    messages = [{"role": "user", "content": "A loop, please."}]
    ids = demo_stack.gateway.chat_prompt(messages)
    kw = dict(model="demo", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=2)
    r = client.chat.completions.create(**kw)
    content = r.choices[0].logprobs.content
    assert len(content) == 10 and r.usage.completion_tokens == 10
    assert "".join(c.token for c in content) == r.choices[0].message.content
    # greedy: each emitted token is the argmax, and its log-probability the raw log-softmax there
    got_ids = []
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token
        assert c.bytes == list(c.token.encode()) and abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6
    rows = target_log_softmax(target, ids + [0])  # the first output position
    assert abs(content[0].logprob - rows[len(ids) - 1].max().item()) < TOL
    got_ids.append(int(rows[len(ids) - 1].argmax()))
    chunks = list(client.chat.completions.create(**kw, stream=True))
    streamed = [c for ch in chunks if ch.choices and ch.choices[0].logprobs for c in ch.choices[0].logprobs.content]
    assert [(c.token, round(c.logprob, 4)) for c in streamed] == [(c.token, round(c.logprob, 4)) for c in content]
    plain = client.chat.completions.create(model="demo", messages=messages, max_tokens=10, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == r.choices[0].message.content


def test_grpc_front_carries_logprobs(demo_stack, tokenizer):
    stub = gateway_pb2_grpc.GatewayServiceStub(grpc.insecure_channel(demo_stack.grpc_address))
    params = common_pb2.SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)
    chunks = list(stub.GenerateStream(gateway_pb2.GatewayServiceGenerateStreamRequest(prompt="x = 1\n", params=params)))
    deltas = [c.delta for c in chunks if c.WhichOneof("chunk") == "delta"] + [chunks[-1].finished]
    ids = [t for d in deltas for t in d.token_ids]
    logprobs = [lp for d in deltas for lp in d.logprobs]
    assert len(ids) == 6 and [lp.token_id for lp in logprobs] == ids
    assert all(len(lp.top_ids) == 2 and lp.top_ids[0] == lp.token_id for lp in logprobs)  # greedy: the argmax
    whole = stub.Generate(gateway_pb2.GatewayServiceGenerateRequest(prompt="x = 1\n", params=params))
    assert list(whole.token_ids) == ids and [lp.token_id for lp in whole.logprobs] == ids


def test_echo_with_logprobs_scores_the_prompt(client, target, tokenizer):
    """lm-eval's loglikelihood request: echo, logprobs, max_tokens 0."""
    prompt = "import os\nimport sys\n"
    ids = ids_of(tokenizer, prompt)
    r = client.completions.create(model="demo", prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    choice = r.choices[0]
    assert choice.text == prompt and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    rows = target_log_softmax(target, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - rows[i - 1, ids[i]].item()) < TOL
    # echo with a completion after it, streamed: the prompt comes first
    chunks = list(
        client.completions.create(model="demo", prompt=prompt, max_tokens=4, echo=True, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks).startswith(prompt)
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model="demo", prompt=prompt, max_tokens=0, temperature=0)


def test_n_choices_and_lists_of_prompts(client, tokenizer, greedy):
    prompts = ["class A:\n", "for i in range(3):\n"]
    want = [greedy(ids_of(tokenizer, p), 8).text for p in prompts]
    r = client.completions.create(model="demo", prompt=prompts, n=2, max_tokens=8, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]  # prompt-major
    assert r.usage.prompt_tokens == sum(len(ids_of(tokenizer, p)) for p in prompts)
    assert r.usage.completion_tokens == 4 * 8
    chunks = list(
        client.completions.create(model="demo", prompt=prompts, n=2, max_tokens=8, temperature=0, stream=True)
    )
    texts = ["", "", "", ""]
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts == [want[0], want[0], want[1], want[1]]
    # independent samples: three different sessions and random streams
    r = client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], n=3, max_tokens=12, temperature=1.0
    )
    assert len(r.choices) == 3 and len({c.message.content for c in r.choices}) > 1


def test_vllm_sampling_extras_are_honoured(client, tokenizer, greedy):
    """Greedy through the services (speculative) = the in-process target-only engine, parameter by parameter;
    a stop token id ends the output (its text left out, as vLLM does)."""
    prompt = "def f(x):\n    return x\n"
    ids = ids_of(tokenizer, prompt)
    base = greedy(ids, 16)
    extras = [
        # The random model's greedy path never repeats a token: penalties that reward repeats change it.
        dict(repetition_penalty=0.2),
        dict(presence_penalty=-2.0, frequency_penalty=-1.5),
        dict(logit_bias={str(base.token_ids[0]): -100.0}),
        dict(bad_words=[tokenizer.decode(base.token_ids[1:3])]),
        dict(min_p=0.3),
    ]
    for extra in extras:
        body = {k: v for k, v in extra.items() if k not in ("presence_penalty", "frequency_penalty")}
        kw = {k: v for k, v in extra.items() if k in ("presence_penalty", "frequency_penalty")}
        r = client.completions.create(model="demo", prompt=prompt, max_tokens=16, temperature=0, extra_body=body, **kw)
        words = ()
        if "bad_words" in extra:
            words = tuple(
                tuple(ids_of(tokenizer, w))
                for w in (extra["bad_words"][0].lstrip(), " " + extra["bad_words"][0].lstrip())
            )
        params = {k: v for k, v in extra.items() if k not in ("logit_bias", "bad_words")}
        if "logit_bias" in extra:
            params["logit_bias"] = ((base.token_ids[0], -100.0),)
        want = greedy(ids, 16, bad_words=tuple(set(words)), **params)
        assert r.choices[0].text == want.text, extra
        if "min_p" not in extra:
            assert want.token_ids != base.token_ids, extra
    stop = base.token_ids[3]
    r = client.completions.create(
        model="demo", prompt=prompt, max_tokens=16, temperature=0, extra_body={"stop_token_ids": [stop]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 4
    assert r.choices[0].text == tokenizer.decode(base.token_ids[:3], skip_special_tokens=True)
    r = client.completions.create(
        model="demo",
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        extra_body={"stop_token_ids": [stop], "min_tokens": 6},
    )
    assert r.usage.completion_tokens >= 6
    for extra, param in [
        ({"min_tokens": 20}, "min_tokens"),
        ({"logit_bias": {"5": 300}}, "logit_bias"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"bad_words": "x"}, "bad_words"),
    ]:
        with pytest.raises(openai.BadRequestError, match=param):
            client.completions.create(model="demo", prompt=prompt, max_tokens=16, extra_body=extra)


def test_processed_law_through_the_services():
    """Through both services (sampled drafts, K = 1, pipelining on): the joint law of the first two tokens
    under penalties, logit_bias, min_p, min_tokens and bad_words is the processed target's (chi-square)."""
    from concurrent.futures import ThreadPoolExecutor

    from specmesh.sampling import BatchSamplingParams, LogitsContext, apply_context_processing, process_logits
    from tests.support.services import draft_stub, generate

    vocab, prompt = LAW_VOCAB, LAW_PROMPT
    target = law_target()
    verify, draft = sampling_services(target, 0.3, steps=1)
    params = SamplingParams(
        temperature=1.0,
        max_tokens=2,
        repetition_penalty=2.0,
        presence_penalty=-1.0,
        frequency_penalty=0.5,
        logit_bias=((0, 1.0),),
        min_p=0.02,
        min_tokens=2,
        bad_words=((4, 5),),
    )
    eos = frozenset({vocab - 1})
    with torch.inference_mode():

        def law(ids):
            logits = target(input_ids=torch.tensor([ids])).logits[0, -1:]
            x = apply_context_processing(logits, [params], [LogitsContext(ids, len(prompt), (), eos)])
            return process_logits(x, BatchSamplingParams.from_params([params], [1]))[0].double()

        p1 = law(prompt)
        joint = torch.stack([p1[a] * law(prompt + [a]) for a in range(vocab)]).reshape(-1)
    assert p1[vocab - 1] == 0 and joint.reshape(vocab, vocab)[4, 5] == 0  # min_tokens and bad_words bite
    pb = wire.params_to_pb(params)
    n = 800
    stub = draft_stub(draft)
    try:
        with ThreadPoolExecutor(8) as pool:
            runs = list(pool.map(lambda _: generate(stub, prompt, pb), range(n)))
    finally:
        draft.stop()
        verify.stop()
    counts = first_two_counts(runs)
    accepted = sum(chunks[-1].finished.stats.accepted for _, chunks in runs)
    assert accepted > n // 5  # the second token often came as a bonus after an accepted draft
    assert counts[joint == 0].sum() == 0
    assert pooled_chisquare(counts, joint, n) > 1e-3

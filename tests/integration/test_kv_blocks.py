"""KV by blocks through the real services: a verify service whose block pool holds a few of 32 concurrent
streams preempts and recomputes, and every REST client still gets the target's own greedy output, with no
failed request; the preemptions are counted where vLLM counts them. The draft's KV serves a re-sent prompt
within its tenant only."""

import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.models import noisy_copy
from tests.support.services import GatewayServer, service_metrics, start_draft, start_verify

BPT = 512  # KV bytes per token of the suite's tiny target: 2 layers x 2 KV heads x 16 dims x (K, V) x fp32


def test_32_streams_through_a_pool_for_a_few_all_succeed_with_the_targets_output(target, tokenizer, greedy):
    # 24 blocks of 16 tokens = 384 tokens for 32 streams of 70 to 110 tokens: a few fit at once
    verify = start_verify(
        target, tokenizer, kv_cache_budget_mb=24 * 16 * BPT / 2**20, max_model_len=160, metrics_port=0
    )
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    gw = GatewayServer([verify.address], [draft.address], tokenizer)
    prompts = [f"def f{i}(x):\n" + "    y = x + 1\n" * (1 + i % 6) for i in range(32)]
    try:
        client = gw.openai(timeout=240)

        def one(prompt: str) -> str:
            reply = client.completions.create(
                model="demo", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
            )
            return reply.choices[0].text

        with ThreadPoolExecutor(32) as pool:
            texts = list(pool.map(one, prompts))  # a failed request raises here
        for prompt, text in zip(prompts, texts, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert text == greedy(ids, 40, ignore_eos=True).text, prompt
        engine = verify.server.engine
        assert engine.scheduler.stats.preemptions > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{verify.server.metrics_port}/metrics", timeout=10) as r:
            page = r.read().decode()
        counted = re.search(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", page, re.M)
        assert counted is not None and float(counted.group(1)) == engine.scheduler.stats.preemptions
        assert engine.runner.pool.num_used == 0  # every block came back
    finally:
        gw.stop()
        draft.stop()
        verify.stop()


def test_a_draft_on_the_paged_runner_serves_the_targets_greedy_output(target, tokenizer, greedy):
    """`--draft-runner paged` (the draft's runner on CUDA, where its steps replay CUDA graphs): the draft's
    blocks hold every session at full length, 8 concurrent REST streams get the target's greedy output, and
    the draft's proposals are accepted (its decoder serves, not only its probe)."""
    verify = start_verify(target, tokenizer)
    draft = start_draft(noisy_copy(target, 0.03), verify.address, draft_runner="paged", max_sessions=8)
    gw = GatewayServer([verify.address], [draft.address], tokenizer)
    prompts = [f"def g{i}(x):\n" + "    y = x * 2\n" * (1 + i % 4) for i in range(8)]
    try:
        runner = draft.server.engine.runner
        assert (
            type(runner).__name__ == "PagedRunner" and runner.context_limit() == target.config.max_position_embeddings
        )
        client = gw.openai(timeout=240)

        def one(prompt: str):
            return client.completions.create(
                model="demo", prompt=prompt, max_tokens=32, temperature=0, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(8) as pool:
            replies = list(pool.map(one, prompts))
        for prompt, reply in zip(prompts, replies, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert reply.choices[0].text == greedy(ids, 32, ignore_eos=True).text, prompt
        assert sum(r.model_extra["specmesh"]["accepted"] for r in replies) > 0
    finally:
        gw.stop()
        draft.stop()
        verify.stop()


@pytest.mark.parametrize("draft_runner", ["batched", "paged"])
def test_the_draft_reuses_a_resent_prompts_kv_in_its_scope_only(target, tokenizer, greedy, draft_runner):
    """A prompt sent again without a session (what the OpenAI client does with a growing conversation) finds
    its KV in the draft's cache, counted in the draft's prefix-cache metrics, and the output is still the
    target's; another API key or another cache_salt finds nothing (a tenant never reads another's cache)."""
    verify = start_verify(target, tokenizer)
    draft = start_draft(
        noisy_copy(target, 0.03), verify.address, draft_runner=draft_runner, max_sessions=4, metrics_port=0
    )
    gw = GatewayServer([verify.address], [draft.address], tokenizer, api_keys=("sk-a", "sk-b"))
    prompt = "def area(r):\n" + "    return 3.14159 * r * r\n" * 6
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    expected = greedy(ids, 24, ignore_eos=True).text

    def hits_after(key: str, **extra) -> tuple[float, float]:
        reply = gw.openai(key).completions.create(
            model="demo", prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True, **extra}
        )
        assert reply.choices[0].text == expected
        m = service_metrics(draft)
        return m[("specmesh_draft_prefix_cache_queries_total", ())], m[("specmesh_draft_prefix_cache_hits_total", ())]

    try:
        assert hits_after("sk-a") == (len(ids), 0)
        queries, hits = hits_after("sk-a")
        assert queries == 2 * len(ids) and hits >= len(ids) - 16  # the paged runner finds whole blocks
        assert hits_after("sk-b")[1] == hits
        assert hits_after("sk-a", cache_salt="s1")[1] == hits
        # A session's first turn opens in its tenant's and salt's scope too.
        assert hits_after("sk-a", session_id="chat", cache_salt="s2")[1] == hits
        assert hits_after("sk-a", session_id="chat")[1] >= hits + len(ids) - 16
    finally:
        gw.stop()
        draft.stop()
        verify.stop()

"""`--runner gguf` / `--draft-runner gguf` through the real services: llama.cpp's kernels behind the verify
and draft services, REST clients get the target's own greedy output token for token, sampled requests are
served, and a pool of cells for a few of 16 concurrent streams preempts and recomputes without a failed
request."""

from concurrent.futures import ThreadPoolExecutor

from specmesh.models import load_model
from tests.support.models import ROOT, greedy_decoder, noisy_copy
from tests.support.services import GatewayServer, start_draft, start_verify

BPT = 512  # KV bytes per token of the suite's tiny target (see test_kv_blocks)


def test_the_demo_pair_on_llama_cpp_gives_the_targets_greedy_output():
    target, tokenizer = load_model(ROOT / "models" / "demo" / "target")
    draft, _ = load_model(ROOT / "models" / "demo" / "draft")
    verify = start_verify(target, tokenizer, runner="gguf", kv_cache_budget_mb=256)
    draft_service = start_draft(draft, verify.address, tokenizer=tokenizer, draft_runner="gguf")
    gw = GatewayServer([verify.address], [draft_service.address], tokenizer)
    prompts = ["def fibonacci(n):\n", "class Stack:\n    def __init__(self):\n", "import os\n\n\ndef walk(", "# "]
    try:
        assert type(verify.server.engine.runner).__name__ == "GgufRunner"
        client = gw.openai(timeout=240)

        def one(prompt: str):
            return client.completions.create(
                model="demo", prompt=prompt, max_tokens=48, temperature=0, extra_body={"ignore_eos": True}
            )

        with ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(one, prompts))
        greedy = greedy_decoder(target, tokenizer)
        for prompt, reply in zip(prompts, replies, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert reply.choices[0].text == greedy(ids, 48, ignore_eos=True).text, prompt
        spec = replies[0].model_extra["specmesh"]
        assert spec["drafted"] > 0 and spec["accepted"] > 0  # served speculatively, the draft on llama.cpp too
        sampled = client.completions.create(model="demo", prompt=prompts[0], max_tokens=24, temperature=0.7, seed=3)
        assert sampled.usage.completion_tokens > 0
    finally:
        gw.stop()
        draft_service.stop()
        verify.stop()


def test_16_streams_through_a_pool_of_cells_for_a_few_all_succeed(target, tokenizer, greedy):
    verify = start_verify(target, tokenizer, runner="gguf", kv_cache_budget_mb=24 * 16 * BPT / 2**20, max_model_len=160)
    draft = start_draft(noisy_copy(target, 0.03), verify.address)
    gw = GatewayServer([verify.address], [draft.address], tokenizer)
    prompts = [f"def f{i}(x):\n" + "    y = x + 1\n" * (1 + i % 6) for i in range(16)]
    try:
        client = gw.openai(timeout=240)

        def one(prompt: str) -> str:
            reply = client.completions.create(
                model="demo", prompt=prompt, max_tokens=40, temperature=0, extra_body={"ignore_eos": True}
            )
            return reply.choices[0].text

        with ThreadPoolExecutor(16) as pool:
            texts = list(pool.map(one, prompts))  # a failed request raises here
        for prompt, text in zip(prompts, texts, strict=True):
            ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
            assert text == greedy(ids, 40, ignore_eos=True).text, prompt
        engine = verify.server.engine
        assert engine.scheduler.stats.preemptions > 0
        assert engine.runner.blocks.free_blocks() == engine.runner.blocks.num_blocks  # every cell came back
    finally:
        gw.stop()
        draft.stop()
        verify.stop()

"""VerifyEngine on the block pool (the default runner), without gRPC: a session reaches the model's whole
context; sessions that share a prompt prefix hold its blocks once, within one scope only; a pool too small
for the load admits by blocks, evicts idle sessions, then preempts running ones and recomputes them, and
every output is still the target's own; every block comes back."""

import asyncio
import logging
import random
import time

import pytest
import torch

from specmesh.domain import DraftBlock, Finished, Opened, Tokens
from tests.support.engines import BLOCK, greedy, make_engine, run
from tests.support.models import tiny_model
from verify_service.engine import END_OF_STREAM, BlockIn, VerifyEngine

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=VOCAB, seed=5)


def reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's own greedy continuation (EOS not special), with the stock HF forward and its cache."""
    out: list[int] = []
    with torch.inference_mode():
        step = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            out.append(int(step.logits[0, -1].argmax()))
            step = model(input_ids=torch.tensor([out[-1:]]), past_key_values=step.past_key_values, use_cache=True)
    return out


async def generate(engine: VerifyEngine, prompt: list[int], n: int, session_id: str = "", scope: str = ""):
    """Target-only: (Opened, the tokens)."""
    events = [e async for e in engine.generate(session_id, prompt, greedy(n), scope)]
    assert isinstance(events[-1], Finished)
    assert isinstance(events[0], Opened)
    return events[0], [t for e in events if isinstance(e, Tokens) for t in e.token_ids]


async def speculate(engine: VerifyEngine, prompt: list[int], truth: list[int], k: int, rng: random.Random):
    """A session's Verify stream with draft blocks of `k` tokens of which each is right with probability
    0.7 (so blocks are partly rejected and rolled back): the tokens emitted."""
    opened = await engine.open("", prompt, greedy(len(truth)))
    inbox: asyncio.Queue = asyncio.Queue()
    out: list[int] = []

    def block(epoch: int) -> BlockIn:
        good = (truth + [0] * k)[len(out) : len(out) + k]
        draft = [t if rng.random() < 0.7 else (t + 1) % VOCAB for t in good]
        return BlockIn(opened.session_id, epoch, len(prompt) + len(out), DraftBlock(draft))

    inbox.put_nowait(block(0))
    async for verdict in engine.session_stream(inbox):
        out += verdict.tokens
        inbox.put_nowait(block(verdict.epoch + 1))
    inbox.put_nowait(END_OF_STREAM)
    return out


def test_one_session_reaches_the_models_whole_context(model):
    engine = make_engine(model, kv_cache_budget_mb=64)
    assert engine.max_context == 1024
    prompt = [(5 * i + 1) % VOCAB for i in range(900)]
    truth = reference(model, prompt, 124)

    async def body(engine):
        return await generate(engine, prompt, 124)

    _, out = run(engine, body)
    assert out == truth
    assert engine.runner.pool.num_used == 0  # an ephemeral session's blocks go back with its call


def test_sessions_sharing_a_prompt_prefix_hold_its_blocks_once_and_only_within_their_scope(model):
    engine = make_engine(model, kv_cache_budget_mb=16)
    pool = engine.runner.pool
    prefix = [(3 * i + 7) % VOCAB for i in range(200)]

    async def body(engine):
        first, _ = await generate(engine, prefix + [1, 2], 4, session_id="a", scope="tenant-1")
        used = pool.num_used
        second, _ = await generate(engine, prefix + [3, 4, 5], 4, session_id="b", scope="tenant-1")
        shared = pool.num_shared
        other, _ = await generate(engine, prefix + [1, 2], 4, session_id="c", scope="tenant-2")
        return first, second, other, used, shared

    first, second, other, used, shared = run(engine, body)
    assert first.cached_prompt_tokens == 0
    assert second.cached_prompt_tokens == 192  # the prefix's 12 full blocks
    assert shared == 12 and used == -(-(202 + 4) // BLOCK)
    assert other.cached_prompt_tokens == 0  # another scope: no hit, though the tokens are the same


def test_sessions_admitted_together_compute_their_common_prefix_once(model):
    """Opened at once, before any of them computed it: the later ones' chunks find the prefix in the cache
    as the first session's chunks fill it."""
    engine = make_engine(model, kv_cache_budget_mb=16, max_batch_tokens=128, prefill_chunk_tokens=128)
    prefix = [(11 * i + 2) % VOCAB for i in range(400)]
    prompts = [prefix + [i, i + 1, i + 2] for i in range(6)]
    truths = [reference(model, p, 6) for p in prompts]

    async def body(engine):
        return await asyncio.gather(*(generate(engine, p, 6) for p in prompts))

    results = run(engine, body)
    assert [out for _, out in results] == truths
    # 6 x 403 prompt tokens; the prefix's 25 full blocks are computed once, so ~400 + 6 x ~3 in all
    assert engine.scheduler.stats.prefill_tokens < 2 * 403
    assert sum(o.cached_prompt_tokens for o, _ in results) >= 5 * 384


def test_out_of_blocks_under_load_preempts_and_recomputes_and_every_output_is_the_targets(model):
    # 12 blocks = 192 tokens for 8 streams of 100 to 135 tokens: far from all of them fit at once
    engine = make_engine(model, blocks=12, max_model_len=160, max_spec_len=4)
    rng = random.Random(3)
    prompts = [[rng.randrange(VOCAB) for _ in range(30 + 5 * i)] for i in range(8)]
    truths = [reference(model, p, 70) for p in prompts]

    async def body(engine):
        spec = [speculate(engine, p, t, 4, random.Random(i)) for i, (p, t) in enumerate(zip(prompts, truths))]
        return await asyncio.gather(*spec[:4], *(generate(engine, p, 70) for p in prompts[4:]))

    results = run(engine, body)
    outs = results[:4] + [out for _, out in results[4:]]
    assert outs == truths
    st = engine.scheduler.stats
    assert st.preemptions > 0 and st.recomputed_tokens > 0
    assert engine.runner.pool.num_used == 0  # every block came back


def test_idle_sessions_give_their_blocks_to_new_ones_lru_and_a_waiting_opening_goes_on_later(model):
    engine = make_engine(model, blocks=10, max_model_len=96)
    pool = engine.runner.pool

    async def body(engine):
        for sid in "abc":  # 3 named sessions whose turn ended (idle, cached for a next turn) of 3 blocks each
            await generate(engine, [ord(sid) % VOCAB] * 40, 8, session_id=sid)
        assert pool.num_free == 1
        await generate(engine, [9] * 40, 8)  # needs 3 and the watermark: a (least recently used) is evicted
        assert engine.sessions.peek("a") is None and engine.sessions.evicted == 1
        assert engine.sessions.peek("b") is not None and engine.sessions.peek("c") is not None
        # a running session holds most of the pool; an opening that does not fit waits for it, not 429
        engine.sessions.get("c").attached = True  # in use: never evicted
        long = asyncio.create_task(generate(engine, [7] * 60, 30))
        await asyncio.sleep(0.05)
        late = await generate(engine, [8] * 50, 4)
        return late, await long

    (late_opened, late), (_, long_out) = run(engine, body)
    assert late == reference(model, [8] * 50, 4) and long_out == reference(model, [7] * 60, 30)
    assert engine.sessions.evicted >= 2


@pytest.mark.parametrize("fail", [False, True])
def test_an_open_returns_as_its_last_chunk_begins_and_its_first_block_joins_the_next_pass(model, fail):
    """The open is answered when the pass that computes its prompt's last chunk begins, so the session's
    first block reaches the queue while that pass runs and is verified in the very next one (answered after
    the pass, it would arrive once the next had begun). If that pass fails, the first step computes what the
    cache lacks: the output is still the target's."""
    engine = make_engine(model, kv_cache_budget_mb=16)
    prompt = [(7 * i + 3) % VOCAB for i in range(300)]
    truth = reference(model, prompt, 8)
    sched = engine.scheduler
    forward = sched._forward
    passes: list[tuple[int, int]] = []  # (blocks, prefill chunks) per pass
    chunk_end: list[float] = []

    def slow_forward(batch, plan):
        passes.append((len(batch), len(plan)))
        if not plan:
            return forward(batch, plan)
        try:
            time.sleep(0.3)  # long enough for the open's caller to run meanwhile
            if fail:
                raise RuntimeError("injected: the last chunk's pass fails")
            return forward(batch, plan)
        finally:
            chunk_end.append(time.perf_counter())

    sched._forward = slow_forward

    async def body(engine):
        opened = await engine.open("", prompt, greedy(8))
        answered = time.perf_counter()
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait(BlockIn(opened.session_id, 0, len(prompt), DraftBlock(truth[:3])))
        out: list[int] = []
        async for verdict in engine.session_stream(inbox):
            out += verdict.tokens
            if len(out) >= 8:
                inbox.put_nowait(END_OF_STREAM)
            else:
                inbox.put_nowait(BlockIn(opened.session_id, verdict.epoch + 1, len(prompt) + len(out), DraftBlock([])))
        return answered, out

    answered, out = run(engine, body)
    assert answered < chunk_end[0]  # answered while the pass computing its last chunk was still running
    assert passes[:2] == [(0, 1), (1, 0)]  # its first block in the pass right after
    assert out[:8] == truth
    if not fail:
        assert engine.scheduler.stats.prefill_tokens == len(prompt) - 1


def test_a_turn_released_while_its_last_chunk_is_computed_gives_its_blocks_back_after_that_pass(model, caplog):
    """The open is answered while the pass computing its prompt's last chunk runs, so a ReleaseSession (or an
    eviction) can come before that pass ends: its blocks go back once the pass is done with them (freed
    under it, the pass's bookkeeping would fail on an emptied table). The pool is whole after it and the
    next request's output is the target's."""
    engine = make_engine(model, kv_cache_budget_mb=16)
    prompt = [(5 * i + 2) % VOCAB for i in range(300)]
    truth = reference(model, prompt, 6)
    sched = engine.scheduler
    forward = sched._forward

    def slow_forward(batch, plan):
        if plan:
            time.sleep(0.3)
        return forward(batch, plan)

    sched._forward = slow_forward

    async def body(engine):
        await engine.open("turn", prompt, greedy(6))
        assert engine.release("turn")  # its last chunk's pass is still running
        while engine.scheduler._in_pass:
            await asyncio.sleep(0.01)
        held_after = engine.runner.pool.num_used
        _, out = await generate(engine, prompt, 6)
        return held_after, out

    held_after, out = run(engine, body)
    assert held_after == 0 and out == truth
    assert engine.runner.pool.num_used == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no pass failed
    assert engine.scheduler.stats.prefill_tokens >= len(prompt) - 1  # the released turn's chunk ran whole


@pytest.mark.parametrize("tail", [1, 9, 33, 40])
def test_a_prompt_cached_but_for_a_short_tail_is_computed_by_its_first_step(model, tail):
    """A turn whose prompt the cache holds but for at most FOLD_TOKENS tokens is answered at once (no chunk),
    and its first step computes the tail with its block, one pass to the first token; a longer tail is a
    chunk of its own. Either way the output is the target's and the cached prefix is reported."""
    from verify_service.scheduler import FOLD_TOKENS

    engine = make_engine(model)
    base = [(3 * i + 1) % VOCAB for i in range(4 * BLOCK)]
    prompt = base + [(7 * i + 5) % VOCAB for i in range(tail)]  # the tail: uncached, the last token aside
    truth = reference(model, prompt, 8)

    async def body(engine):
        await generate(engine, base + [0], 2)  # caches base's blocks
        stats = engine.scheduler.stats
        chunks, tokens, forwards = stats.prefill_chunks, stats.prefill_tokens, stats.forwards
        opened, out = await generate(engine, prompt, 8)
        return opened, out, stats.prefill_chunks - chunks, stats.prefill_tokens - tokens, stats.forwards - forwards

    opened, out, chunks, tokens, forwards = run(engine, body)
    assert out == truth and opened.cached_prompt_tokens == len(base)
    folded = tail - 1 <= FOLD_TOKENS
    assert engine.scheduler.stats.folded_prefills == (1 if folded else 0)
    assert (chunks, tokens) == ((0, 0) if folded else (1, tail - 1))
    assert forwards == 8 if folded else forwards == 9  # a pass per token, plus the tail's own when not folded

"""The batched drafter: a block is drafted in one run of forwards on the model thread, sessions that ask
together draft together, and a cancelled block still leaves its sequence clean."""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor

import torch

from specmesh.drafters import DraftBatcher, ModelDrafter
from specmesh.runtime.batched import BatchedRunner
from specmesh.sampling import SamplingParams
from tests.support.models import tiny_model

GREEDY = SamplingParams(temperature=0.0)
PROMPTS = [[1, 2, 3, 4], [5, 6, 7], [8, 9, 10, 11, 12], [13, 14]]


def threaded(executor: ThreadPoolExecutor, calls: list | None = None):
    async def run(fn, *args):
        if calls is not None:
            calls.append(fn)
        return await asyncio.get_running_loop().run_in_executor(executor, fn, *args)

    return run


def alone(model, prompt: list[int], k: int) -> list[int]:
    async def run():
        d = ModelDrafter(DraftBatcher(BatchedRunner(model, num_slots=2, max_seq_len=128)))
        await d.start(prompt, GREEDY)
        return (await d.propose(k)).token_ids

    return asyncio.run(run())


def test_sessions_that_ask_together_draft_their_blocks_in_one_run():
    model = tiny_model("llama", seed=3)
    ks = [4, 4, 2, 3]
    calls: list = []
    with ThreadPoolExecutor(1) as pool:
        batcher = DraftBatcher(BatchedRunner(model, num_slots=8, max_seq_len=128), execute=threaded(pool, calls))
        drafters = [ModelDrafter(batcher) for _ in PROMPTS]

        async def run():
            for d, p in zip(drafters, PROMPTS, strict=True):
                await d.start(p, GREEDY)
            before = (batcher.stats.forwards, batcher.stats.rows)
            calls.clear()
            blocks = await asyncio.gather(*(d.propose(k) for d, k in zip(drafters, ks, strict=True)))
            return blocks, before

        with torch.inference_mode():
            blocks, (forwards0, rows0) = asyncio.run(run())
    # One run, one hand-off to the model thread: as many forwards as the longest block, each advancing every
    # session still short of its k.
    assert len(calls) == 1
    assert batcher.stats.forwards - forwards0 == max(ks)
    assert batcher.stats.rows - rows0 == sum(ks)
    assert [b.k for b in blocks] == ks
    for d, p in zip(drafters, PROMPTS, strict=True):
        assert d.state.seq.token_ids == p  # drafts stay out of the committed ids
    # Drafting together changes nothing a session drafts.
    for b, p, k in zip(blocks, PROMPTS, ks, strict=True):
        assert b.token_ids == alone(model, p, k)


def test_a_cancelled_block_waits_for_its_run_and_leaves_the_sequence_clean():
    model = tiny_model("llama", seed=5)
    prompt = [3, 1, 4, 1, 5]
    with ThreadPoolExecutor(1) as pool:
        batcher = DraftBatcher(BatchedRunner(model, num_slots=2, max_seq_len=128), execute=threaded(pool))
        drafter = ModelDrafter(batcher)

        async def run():
            await drafter.start(prompt, GREEDY)
            task = asyncio.ensure_future(drafter.propose(8))
            while batcher.stats.forwards == 0:  # the run is under way on the model thread
                await asyncio.sleep(0.001)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            # The run had ended by the time the cancellation went through: nothing writes the ids now.
            assert drafter.state.seq.token_ids == prompt
            return (await drafter.propose(4)).token_ids

        with torch.inference_mode():
            again = asyncio.run(run())
    assert again == alone(model, prompt, 4)


def test_drafting_ahead_goes_a_token_at_a_time_and_stops_when_told():
    model = tiny_model("llama", seed=7)
    prompt = [2, 7, 1, 8]
    batcher = DraftBatcher(BatchedRunner(model, num_slots=2, max_seq_len=128))
    drafter = ModelDrafter(batcher)
    asked = []

    def should_stop() -> bool:
        asked.append(batcher.stats.forwards)
        return len(asked) > 3

    async def run():
        await drafter.start(prompt, GREEDY)
        return await drafter.propose(10, should_stop=should_stop)

    with torch.inference_mode():
        block = asyncio.run(run())
    assert block.k == 3  # asked before each token: three went through, the fourth check stopped it
    assert asked == sorted(asked) and len(set(asked)) == 4  # one forward between checks
    assert block.token_ids == alone(model, prompt, 3)


def test_a_prefill_begun_in_the_background_takes_the_tokens_committed_meanwhile():
    """`begin` returns with the prefill still to run on the model thread; tokens committed meanwhile are
    committed after it, and the next block is the one an eagerly started drafter drafts after the same
    tokens. Released while its prefill runs, the sequence goes back to the pool when the prefill ends."""
    model = tiny_model("llama", seed=3)
    prompt, later = [1, 2, 3, 4, 5, 6], [7, 8]
    gate = asyncio.Event()
    with ThreadPoolExecutor(1) as pool:
        run_threaded = threaded(pool)

        async def held(fn, *args):  # the model thread's first hand-off waits for the gate
            await gate.wait()
            return await run_threaded(fn, *args)

        runner = BatchedRunner(model, num_slots=2, max_seq_len=128)
        batcher = DraftBatcher(runner, execute=held)

        async def run():
            d = ModelDrafter(batcher)
            await d.begin(prompt, GREEDY)
            assert runner.free_slots == 1 and d.state.seq.cached_ids == []  # opened, not prefilled
            d.commit(later)
            assert d.state.seq.token_ids == prompt  # the model thread's ids are not touched meanwhile
            gate.set()
            block = await d.propose(3)
            assert d.state.seq.token_ids == prompt + later
            gate.clear()
            again = ModelDrafter(batcher)
            await again.begin(prompt, GREEDY)
            again.release()  # while its prefill waits: the slot is still held ...
            assert runner.free_slots == 0
            gate.set()
            for _ in range(100):
                await asyncio.sleep(0.01)
                if runner.free_slots == 1:
                    break
            assert runner.free_slots == 1  # ... and comes back once the prefill has run
            return block.token_ids

        with torch.inference_mode():
            drafted = asyncio.run(run())
    assert drafted == alone(model, prompt + later, 3)

"""VerifyEngine on its runners, without gRPC: the runner choice, the block pool's and the slot pool's sizes,
every session's slot coming back, eviction by slots, and draft blocks cut to fit a session's context.
(Sessions on the block pool: test_verify_blocks.py.)"""

import asyncio

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from specmesh.domain import DraftBlock, Finished
from specmesh.errors import InvalidArgument, NotFound, ResourceExhausted
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from specmesh.runtime.paged import PagedRunner
from tests.support.engines import BPT, MiB, greedy, make_engine, run
from tests.support.models import tiny_model
from verify_service.engine import END_OF_STREAM, BlockIn, VerifyConfig, VerifyEngine
from verify_service.runner import BlockPlan, BudgetError, SlotPlan, build_runner, plan_blocks, plan_slots

VOCAB = 128


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=VOCAB, seed=5)


def reference(model, prompt: list[int], n: int) -> list[int]:
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


# sizing and choice -----------------------------------------------------------------------------------

DEMO_BPT = 2 * 10 * 8 * 64 * 4  # the demo target in fp32: 10 layers, 8 KV heads of 64


@pytest.mark.parametrize(
    "args,plan",
    [
        # the model's 2048 tokens for 64 sessions would need 5 GiB of a 2 GiB budget: slots are shortened
        ((2048, DEMO_BPT, 2048 * MiB, 64), SlotPlan(819, 64)),
        ((2048, DEMO_BPT, 2048 * MiB, 16), SlotPlan(2048, 25)),  # fewer sessions: full length, spare slots
        ((2048, DEMO_BPT, 2048 * MiB, 64, 512), SlotPlan(512, 102)),  # --max-model-len given
        ((2048, DEMO_BPT, 2048 * MiB, 1, 4096), SlotPlan(2048, 25)),  # never longer than the model's context
        ((100, BPT, MiB, 8), SlotPlan(100, 20)),  # a model shorter than the floor: its own context
    ],
)
def test_the_slot_pool_holds_max_sessions_slots_within_the_budget(args, plan):
    got = plan_slots(*args)
    assert got == plan
    assert got.num_slots >= args[3] and got.num_slots * got.slot_len * args[1] <= args[2]


@pytest.mark.parametrize(
    "args,message",
    [
        ((2048, DEMO_BPT, 2048 * MiB, 64, 2048), "holds 25 slots of 2048 tokens, fewer than --max-sessions 64"),
        ((1024, BPT, 12 * 1024, 64), "gives each of --max-sessions 64 sessions 0 tokens"),
    ],
)
def test_a_budget_too_small_for_the_slots_is_refused(args, message):
    with pytest.raises(ValueError, match=message):
        plan_slots(*args)


@pytest.mark.parametrize(
    "args,plan",
    [
        # the README's defaults on the demo target: the model's whole context, 52k tokens shared by all
        ((2048, DEMO_BPT, 2048 * MiB, 16), BlockPlan(3276, 16, 2048)),
        ((2048, DEMO_BPT, 2048 * MiB, 16, 512), BlockPlan(3276, 16, 512)),  # --max-model-len caps a session
        ((2048, DEMO_BPT, 2048 * MiB, 16, 4096), BlockPlan(3276, 16, 2048)),  # never past the model's context
        ((1024, BPT, 1024 * BPT, 256), BlockPlan(4, 256, 1024)),  # exactly one whole sequence
    ],
)
def test_the_block_pool_is_the_budget_in_blocks_and_a_session_the_models_whole_context(args, plan):
    assert plan_blocks(*args) == plan
    assert plan.describe() == (
        f"KV: {plan.num_blocks} blocks of {plan.block_size} tokens = {plan.tokens} tokens; "
        f"max_model_len {plan.max_model_len}"
    )


def test_a_budget_below_one_sequence_is_a_configuration_error():
    with pytest.raises(BudgetError, match=r"holds 3 blocks of 256 tokens \(768 tokens\), fewer than one sequence"):
        plan_blocks(1024, BPT, 1024 * BPT - 1, 256)
    with pytest.raises(BudgetError, match="set --max-model-len"):
        plan_blocks(0, BPT, MiB, 16)


def test_auto_takes_the_paged_runner_for_the_llama_family(model):
    engine = make_engine(model, kv_cache_budget_mb=64)
    assert isinstance(engine.runner, PagedRunner) and engine.runner.blocks is not None
    assert engine.max_context == 1024  # the model's context, for every session
    assert engine.runner.pool.num_blocks == 64 * MiB // (16 * BPT) and engine.runner.block_size == 16
    assert engine.info()["max_context_length"] == 1024
    batched = make_engine(model, runner="batched", kv_cache_budget_mb=64)
    assert isinstance(batched.runner, BatchedRunner) and batched.runner.blocks is None
    assert batched.runner.slot_len == batched.max_context == 1024  # the model's context: the budget allows it
    assert batched.runner.num_slots == 64 * MiB // (1024 * BPT) == 128
    assert batched.sessions.budget_bytes == batched.runner.pool_bytes == 64 * MiB
    hf = make_engine(model, runner="hf", kv_cache_budget_mb=64, max_model_len=300)
    assert isinstance(hf.runner, ModelRunner) and hf.max_context == 300


def test_auto_falls_back_to_the_hf_runner_and_batched_refuses():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)).eval()
    assert isinstance(build_runner(gpt2, "auto"), ModelRunner)  # no batched decoder for this architecture
    with pytest.raises(ValueError, match="no decoder for GPT2LMHeadModel"):
        build_runner(gpt2, "batched")
    llama = tiny_model("llama", vocab=VOCAB)
    tiny_budget = dict(budget_bytes=12 * 1024, max_sessions=64)  # not one whole sequence, nor one slot each
    for kind in ("auto", "paged", "batched"):
        with pytest.raises(BudgetError, match="fewer than"):
            build_runner(llama, kind, **tiny_budget)
    with pytest.raises(ValueError, match="runner must be one of"):
        VerifyConfig(runner="fast")


# sessions on the slot pool ------------------------------------------------------------------------------


def test_a_thousand_sessions_opened_and_released_leave_every_slot_free(model):
    # 32 slots of 64 tokens for at most 8 busy sessions: the 1,000 sessions reuse them over and over
    engine = make_engine(
        model, runner="batched", max_sessions=8, max_model_len=64, kv_cache_budget_mb=32 * 64 * BPT / MiB
    )
    runner = engine.runner
    assert isinstance(runner, BatchedRunner) and runner.num_slots == 32

    async def body(engine: VerifyEngine):
        for i in range(1000):
            prompt = [1 + i % 50, 2 + i % 7, 3, 4 + i % 11]
            kind = i % 5
            if kind == 0:  # a named session's turn, released by its owner
                await engine.open(f"s{i}", prompt, greedy(4))
                assert engine.release(f"s{i}")
            elif kind == 1:  # target-only Generate: its ephemeral session goes when the call ends
                events = [e async for e in engine.generate("", prompt, greedy(2))]
                assert isinstance(events[-1], Finished)
            elif kind == 2:  # left idle: evicted LRU when the slots run out
                await engine.open(f"idle{i}", prompt, greedy(4))
            elif kind == 3:  # a client gone mid-prefill: the ephemeral session it opened goes too
                task = asyncio.create_task(engine.open("", prompt, greedy(4)))
                await asyncio.sleep(0)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:  # a second turn of an idle session, if it is still cached
                sid = f"idle{i - 2}"
                if engine.sessions.peek(sid) is not None:
                    await engine.open(sid, prompt + [5, 6], greedy(4))
            # every cached session holds exactly one slot, and no slot is held by anything else
            assert runner.free_slots == runner.num_slots - len(engine.sessions)
        assert engine.sessions.evicted > 0
        cached = len(engine.sessions)
        assert cached > 0 and engine.sessions.evict_expired(now=float("inf")) == cached

    run(engine, body)
    assert len(engine.sessions) == 0 and engine.sessions.kv_bytes() == 0
    assert runner.free_slots == runner.num_slots and runner.kv_bytes() == 0


def test_idle_sessions_are_evicted_by_slots_and_busy_ones_never(model):
    engine = make_engine(
        model, runner="batched", max_sessions=3, max_model_len=64, kv_cache_budget_mb=3 * 64 * BPT / MiB
    )
    runner = engine.runner
    assert isinstance(runner, BatchedRunner) and runner.num_slots == 3

    async def body(engine: VerifyEngine):
        for sid in "abc":
            await engine.open(sid, [1, 2, 3, ord(sid) % VOCAB], greedy(8))
        assert runner.free_slots == 0
        await engine.open("d", [7, 8, 9], greedy(8))  # no slot free: a, the least recently used, goes
        assert engine.sessions.peek("a") is None and engine.sessions.evicted == 1
        with pytest.raises(NotFound):
            engine.sessions.get("a")
        engine.sessions.get("b").attached = engine.sessions.get("c").attached = True
        await engine.open("e", [7, 8, 9], greedy(8))  # d is the only idle one
        assert engine.sessions.peek("d") is None and engine.sessions.evicted == 2
        engine.sessions.get("e").attached = True
        with pytest.raises(ResourceExhausted, match="limit of 3 concurrent sessions"):
            await engine.open("f", [1, 2], greedy(8))
        assert engine.sessions.evicted == 2 and len(engine.sessions) == 3  # nobody was evicted for it
        info = engine.info()
        assert info["sessions"] == 3 and info["kv_cache_bytes"] == 3 * runner.slot_bytes
        assert info["evicted_sessions"] == 2 and info["max_context_length"] == 64

    run(engine, body)


def test_a_draft_block_is_cut_to_fit_the_slot(model):
    engine = make_engine(model, max_sessions=1, max_model_len=32, max_spec_len=8, kv_cache_budget_mb=2 * 32 * BPT / MiB)
    prompt = list(range(10, 30))  # 20 tokens: with max_tokens 12 the session ends exactly at the slot's end
    truth = reference(model, prompt, 12)

    async def body(engine: VerifyEngine):
        with pytest.raises(InvalidArgument, match="context length 32"):
            await engine.open("s", prompt, greedy(13))
        opened = await engine.open("s", prompt, greedy(12))
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait(BlockIn("s", 0, opened.base_position, DraftBlock(truth[:8])))
        verdicts, out = [], []
        async for verdict in engine.session_stream(inbox):
            verdicts.append(verdict)
            out += verdict.tokens
            # always a full block of 8, though at most 2 can still be kept and 3 positions are left
            inbox.put_nowait(
                BlockIn(
                    "s",
                    verdict.epoch + 1,
                    len(prompt) + len(out),
                    DraftBlock((truth + [1] * 8)[len(out) : len(out) + 8]),
                )
            )
        inbox.put_nowait(END_OF_STREAM)
        return verdicts, out, engine.sessions.get("s").position

    verdicts, out, position = run(engine, body)
    assert out == truth and position == 32
    assert [(v.num_drafted, v.num_accepted) for v in verdicts] == [(8, 8), (2, 2)]
    assert verdicts[-1].finish_reason == "length"


def test_a_run_of_target_only_steps_takes_no_block_per_step_and_a_block_ends_it(model):
    """VerifyRequest.target_only_steps: the steps of a run come without further blocks (and without the
    draft deadline: it is an hour here); a block that arrives during a run ends the run and is verified."""
    engine = make_engine(model, draft_deadline_ms=3_600_000)
    prompt = list(range(10, 20))
    truth = reference(model, prompt, 16)

    async def body(engine: VerifyEngine):
        opened = await engine.open("s", prompt, greedy(16))
        inbox: asyncio.Queue = asyncio.Queue()
        inbox.put_nowait(BlockIn("s", 0, opened.base_position, DraftBlock([]), target_only_steps=5))
        verdicts, out = [], []

        def send(block: DraftBlock, steps: int = 0) -> None:
            inbox.put_nowait(BlockIn("s", verdicts[-1].epoch + 1, len(prompt) + len(out), block, steps))

        async with asyncio.timeout(60):  # a step waiting for a block would wait for the hour-long deadline
            async for verdict in engine.session_stream(inbox):
                verdicts.append(verdict)
                out += verdict.tokens
                if len(verdicts) == 5:  # the run is over: nothing comes unless asked
                    send(DraftBlock(truth[5:8]))
                elif len(verdicts) == 6:
                    send(DraftBlock([]), steps=10)
                elif len(verdicts) == 7:  # one step of that run taken: a block ends it
                    send(DraftBlock(truth[10:13]))
                elif len(verdicts) == 8:
                    inbox.put_nowait(END_OF_STREAM)
        return verdicts, out

    verdicts, out = run(engine, body)
    assert out == truth[:14]
    assert [(v.num_drafted, v.num_accepted, v.deadline) for v in verdicts] == [(0, 0, False)] * 5 + [
        (3, 3, False),
        (0, 0, False),
        (3, 3, False),
    ]
    assert engine.counters.run_steps == 4 and engine.counters.deadline_steps == 0

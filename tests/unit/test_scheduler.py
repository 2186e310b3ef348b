"""The verify service's batching tick (verify_service.scheduler.Scheduler), without gRPC.

A tiny target model and the torch rejection sampler; each test drives the scheduler on its own event
loop (`asyncio.run`). Sessions are built the way VerifyEngine.open builds them: a prefilled sequence,
the turn's SamplingParams, its StopChecker and generator, epoch 0. The batching tests run on both
runners the service can have (ModelRunner, BatchedRunner); the chunked-prefill tests on BatchedRunner,
whose prefill chunks ride in the ticks' forwards.
"""

import asyncio
import os
import time

import pytest
import torch

from specmesh.domain import DraftBlock
from specmesh.models import eos_token_ids
from specmesh.rejection import RejectionInput, RejectionSampler
from specmesh.runtime.batched import BatchedRunner
from specmesh.runtime.hf import ModelRunner
from specmesh.sampling import SamplingParams, StopChecker, make_generator
from tests.support.models import tiny_model
from verify_service.scheduler import Scheduler
from verify_service.sessions import Session

VOCAB = 128
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
PROMPTS = [[5, 9, 2, 33, 17], [40, 41, 42, 43, 44, 45, 46, 47], [100, 3], [7, 7, 7, 8, 60, 61], [90, 12, 30, 31]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab=VOCAB, seed=5)


@pytest.fixture(scope="module", params=["hf", "batched"])
def runner(model, request):
    return ModelRunner(model) if request.param == "hf" else BatchedRunner(model, num_slots=64, max_seq_len=256)


@pytest.fixture(scope="module")
def batched(model):
    return BatchedRunner(model, num_slots=16, max_seq_len=256)


def reference(model, prompt: list[int], n: int) -> list[int]:
    """The target's greedy continuation, one uncached full forward per token."""
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(n):
            tok = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            out.append(tok)
    return out


def fresh_session(runner, session_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> Session:
    """A session as VerifyEngine.open hands it to the scheduler: its turn set up, nothing prefilled yet. In a
    prefix-cache scope of its own: the module's runners keep freed slots' KV, and no session here may find
    another test's prompt cached."""
    return Session(
        session_id,
        runner.new_sequence(prompt, os.urandom(8)),
        ephemeral=False,
        params=params,
        stop=StopChecker(params, eos_token_ids(runner.model)),
        generator=make_generator(params.seed, runner.device),
        prompt_len=len(prompt),
        epoch=0,
    )


def make_session(runner, session_id: str, prompt: list[int], params: SamplingParams = GREEDY) -> Session:
    """A session as the scheduler gets it after VerifyEngine.open's prefill."""
    session = fresh_session(runner, session_id, prompt, params)
    runner.prefill(session.seq)
    return session


def block(session: Session, draft: list[int] | tuple[int, ...] = ()) -> RejectionInput:
    """A step as the engine submits it: a point-mass draft block (no draft probabilities, as a greedy or
    n-gram draft sends; empty for a target-only step) under the session's parameters and generator."""
    return RejectionInput(DraftBlock(list(draft)), session.params, session.generator)


def run(body, runner, start_first: bool = True, **kwargs):
    """asyncio.run(body(scheduler)) with a started scheduler, closed afterwards; returns (result, stats).

    start_first=False: `body` starts the scheduler itself (to queue steps before the first tick)."""

    async def main():
        scheduler = Scheduler(runner, RejectionSampler("torch", seed=0), **{"max_batch_size": 8, **kwargs})
        if start_first:
            scheduler.start()
        try:
            return await body(scheduler), scheduler.stats
        finally:
            await scheduler.close()

    return asyncio.run(main())


async def queue_then_start(scheduler: Scheduler, steps) -> list[asyncio.Task]:
    """Submit every (session, block) before the scheduler's first tick, then start it."""
    tasks = [asyncio.create_task(scheduler.submit(s, b)) for s, b in steps]
    await asyncio.sleep(0)  # each submit runs up to its await: all are queued
    assert scheduler.queue_depth == len(steps)
    scheduler.start()
    return tasks


def test_steps_of_several_sessions_are_verified_in_one_batch(model, runner):
    sessions = [make_session(runner, f"s{i}", p) for i, p in enumerate(PROMPTS[:4])]

    async def body(scheduler):
        return await asyncio.gather(*(scheduler.submit(s, block(s)) for s in sessions))

    # a generous window: the tick starts when all four expected sessions are in, not when it times out
    results, stats = run(body, runner, batch_wait_s=30.0, expected=lambda: len(sessions))
    assert stats.batches == 1 and stats.batched_blocks == 4
    assert stats.max_batch_size_seen == 4 and stats.batch_size_hist == {4: 1}
    assert [r.load.batch_size for r in results] == [4] * 4
    assert [r.load.batch_tokens for r in results] == [4] * 4
    for s, p, r in zip(sessions, PROMPTS[:4], results, strict=True):
        assert r.tokens == reference(model, p, 1)
        assert s.seq.token_ids == p + r.tokens and s.epoch == 1 and r.epoch == 0


def test_max_batch_size_splits_the_waiting_steps_oldest_first(runner):
    sessions = [make_session(runner, f"s{i}", p) for i, p in enumerate(PROMPTS)]

    async def body(scheduler):
        return await asyncio.gather(*await queue_then_start(scheduler, [(s, block(s)) for s in sessions]))

    results, stats = run(body, runner, start_first=False, max_batch_size=2)
    assert stats.batches == 3 and stats.batch_size_hist == {2: 2, 1: 1}
    assert [r.load.batch_size for r in results] == [2, 2, 2, 2, 1]
    assert stats.max_batch_size_seen == 2 and stats.batched_blocks == 5
    # the load a verdict reports: positions computed by its batch, and the blocks still queued behind it
    assert [r.load.batch_tokens for r in results] == [2, 2, 2, 2, 1]
    assert [r.load.queue_depth for r in results] == [3, 3, 1, 1, 0]


def test_max_batch_size_must_be_positive(runner):
    with pytest.raises(ValueError, match="max_batch_size"):
        Scheduler(runner, RejectionSampler("torch"), max_batch_size=0)


def test_the_batch_window_waits_for_the_expected_sessions(runner):
    def late_pair(delay):
        a, b = make_session(runner, "a", PROMPTS[0]), make_session(runner, "b", PROMPTS[1])

        async def body(scheduler):
            first = asyncio.create_task(scheduler.submit(a, block(a)))
            await asyncio.sleep(delay)  # b's next block is on its way while a's is already waiting
            return await asyncio.gather(first, scheduler.submit(b, block(b)))

        return body

    results, stats = run(late_pair(0.05), runner, batch_wait_s=30.0, expected=lambda: 2)
    assert stats.batches == 1 and [r.load.batch_size for r in results] == [2, 2]
    assert results[0].load.queue_seconds >= 0.04  # a waited for b
    # without a window, whoever is first goes alone
    results, stats = run(late_pair(0.05), runner)
    assert stats.batches == 2 and [r.load.batch_size for r in results] == [1, 1]


def test_the_batch_window_does_not_wait_when_everyone_is_there(runner):
    def pair():
        return [make_session(runner, "a", PROMPTS[0]), make_session(runner, "b", PROMPTS[1])]

    async def body(scheduler):
        return await asyncio.gather(*(scheduler.submit(s, block(s)) for s in sessions))

    for expected, max_batch_size in [(2, 8), (5, 2)]:  # all expected sessions in, or a full batch
        sessions = pair()
        t0 = time.monotonic()
        results, stats = run(
            body, runner, batch_wait_s=30.0, expected=lambda e=expected: e, max_batch_size=max_batch_size
        )
        assert time.monotonic() - t0 < 10.0  # far below the 30 s window
        assert stats.batches == 1 and [r.load.batch_size for r in results] == [2, 2]


def test_the_batch_window_gives_up_on_sessions_that_do_not_come(runner):
    sessions = [make_session(runner, "a", PROMPTS[0]), make_session(runner, "b", PROMPTS[1])]

    async def body(scheduler):
        return await asyncio.gather(*(scheduler.submit(s, block(s)) for s in sessions))

    t0 = time.monotonic()
    results, stats = run(body, runner, batch_wait_s=0.2, expected=lambda: 3)
    assert time.monotonic() - t0 >= 0.2
    assert stats.batches == 1 and [r.load.batch_size for r in results] == [2, 2]
    assert min(r.load.queue_seconds for r in results) >= 0.15


def test_a_cancelled_step_is_skipped(model, runner):
    gone, staying = make_session(runner, "gone", PROMPTS[0]), make_session(runner, "staying", PROMPTS[1])

    async def body(scheduler):
        a, b = await queue_then_start(scheduler, [(gone, block(gone)), (staying, block(staying))])
        a.cancel()  # its stream went away while the step waited
        result = await b
        with pytest.raises(asyncio.CancelledError):
            await a
        return result

    result, stats = run(body, runner, start_first=False)
    assert result.load.batch_size == 1 and result.tokens == reference(model, PROMPTS[1], 1)
    assert stats.batches == 1 and stats.steps == 1
    assert gone.seq.token_ids == PROMPTS[0] and gone.epoch == 0  # never verified, nothing committed


def test_a_failing_step_does_not_fail_the_others_in_its_batch(model, runner):
    good = [make_session(runner, "g0", PROMPTS[0]), make_session(runner, "g1", PROMPTS[1])]
    bad = make_session(runner, "bad", PROMPTS[2])
    bad.seq.token_ids.append(VOCAB + 7)  # an id outside the embedding table: the target forward raises
    drafts = [reference(model, PROMPTS[0], 2), [], [1, 2]]

    async def body(scheduler):
        steps = [(good[0], block(good[0], drafts[0])), (bad, block(bad, drafts[2])), (good[1], block(good[1]))]
        tasks = await queue_then_start(scheduler, steps)
        return await asyncio.gather(*tasks, return_exceptions=True)

    (r0, r_bad, r1), stats = run(body, runner, start_first=False)
    assert isinstance(r_bad, RuntimeError) and "verification failed" in str(r_bad)
    assert r0.tokens == reference(model, PROMPTS[0], 3) and r0.num_accepted == 2
    assert r1.tokens == reference(model, PROMPTS[1], 1)
    # the batch of three failed and was rerun step by step: two batches of one succeeded
    assert stats.batches == 2 and stats.batch_size_hist == {1: 2} and stats.steps == 2
    assert r0.load.batch_size == r1.load.batch_size == 1
    assert bad.epoch == 0 and bad.seq.token_ids == PROMPTS[2] + [VOCAB + 7]  # nothing committed
    assert bad.seq.num_cached == len(PROMPTS[2]) - 1  # the failed forward left its cache as it was


def test_greedy_steps_follow_the_target_argmax_over_many_rounds(model, runner):
    n = 24
    refs = [reference(model, p, n) for p in PROMPTS[:3]]
    sessions = [make_session(runner, f"s{i}", p) for i, p in enumerate(PROMPTS[:3])]

    def draft(i, out, round_):
        """Session 0 drafts the truth, session 1 a wrong token after one right one, session 2 nothing."""
        truth = refs[i][len(out) : len(out) + 3]
        if i == 0:
            return truth
        if i == 1 and len(truth) >= 2:
            return [truth[0], (truth[1] + 1 + round_) % VOCAB]
        return []

    outs = [[] for _ in sessions]

    async def body(scheduler):
        rounds = 0
        while any(len(o) < n for o in outs):
            live = [i for i, o in enumerate(outs) if len(o) < n]
            steps = [scheduler.submit(sessions[i], block(sessions[i], draft(i, outs[i], rounds))) for i in live]
            results = await asyncio.gather(*steps)
            for i, r in zip(live, results, strict=True):
                outs[i] += r.tokens
            rounds += 1
        return outs

    # the window waits for the sessions still generating, as the engine's count of attached ones does
    outs, stats = run(body, runner, batch_wait_s=30.0, expected=lambda: sum(len(o) < n for o in outs))
    for ref, out, s, p in zip(refs, outs, sessions, PROMPTS[:3], strict=True):
        assert out[:n] == ref
        assert s.seq.token_ids == p + out
    assert stats.max_batch_size_seen == 3


def test_stats_count_steps_tokens_and_drafts(model, runner):
    a, b, c = (make_session(runner, k, p) for k, p in zip("abc", PROMPTS[:3], strict=True))
    truth = reference(model, PROMPTS[0], 3)
    wrong = [(reference(model, PROMPTS[1], 1)[0] + 1) % VOCAB, 4]

    async def body(scheduler):
        steps = [(a, block(a, truth)), (b, block(b, wrong)), (c, block(c))]
        return await asyncio.gather(*await queue_then_start(scheduler, steps))

    (ra, rb, rc), stats = run(body, runner, start_first=False)
    assert (ra.num_drafted, ra.num_accepted, len(ra.tokens)) == (3, 3, 4)  # all accepted + the bonus
    assert (rb.num_drafted, rb.num_accepted, len(rb.tokens)) == (2, 0, 1)  # rejected at once: recovered
    assert (rc.num_drafted, rc.num_accepted, len(rc.tokens)) == (0, 0, 1)  # target-only step
    assert stats.steps == 3 and stats.tokens == 6
    assert stats.batches == 1 and stats.batched_blocks == 3
    # vLLM's drafts: only the steps that carried a draft block
    assert stats.spec.drafts == 2 and stats.spec.rounds == 2
    assert stats.spec.drafted == 5 and stats.spec.accepted == 3
    assert stats.spec.drafted_per_pos == [2, 2, 1] and stats.spec.accepted_per_pos == [1, 1, 1]


def test_commit_trims_the_tokens_after_a_stop_token(model, runner):
    prompt = PROMPTS[0]
    truth = reference(model, prompt, 5)
    stop_id = truth[1]
    assert stop_id != truth[0]  # so the stop is the second token, not the first
    params = SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=(stop_id,), ignore_eos=True)
    session = make_session(runner, "s", prompt, params)

    async def body(scheduler):
        return await scheduler.submit(session, block(session, truth[:4]))

    result, stats = run(body, runner)
    assert result.num_accepted == 4  # the verifier accepted all four and drew a bonus...
    assert result.tokens == truth[:2] and result.finish_reason == "stop"  # ...the stop token ends the output
    assert session.seq.token_ids == prompt + truth[:2]  # the session holds exactly what was emitted
    assert session.stop.token_ids == truth[:2] and session.finished
    assert session.epoch == 1 and result.epoch == 0
    assert stats.tokens == 2


def test_commit_trims_the_tokens_past_max_tokens(model, runner):
    truth = reference(model, PROMPTS[1], 5)
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    session = make_session(runner, "s", PROMPTS[1], params)

    async def body(scheduler):
        return await scheduler.submit(session, block(session, truth[:4]))

    result, _ = run(body, runner)
    assert result.tokens == truth[:3] and result.finish_reason == "length"
    assert session.seq.token_ids == PROMPTS[1] + truth[:3]


def test_an_error_after_the_forward_fails_its_batch_and_the_scheduler_keeps_serving(runner):
    """A failing metrics callback (anything after verify_batch) answers that batch with an error; the next
    step is still verified, instead of every later submit hanging on a dead scheduler task."""
    calls = []

    def on_batch(size, seconds):
        calls.append(size)
        if len(calls) == 1:
            raise RuntimeError("metrics backend down")

    async def body(scheduler):
        s = make_session(runner, "s", PROMPTS[0])
        with pytest.raises(RuntimeError, match="verification failed"):
            await asyncio.wait_for(scheduler.submit(s, block(s)), 30)
        return await asyncio.wait_for(scheduler.submit(s, block(s)), 30)

    verdict, _ = run(body, runner, on_batch=on_batch)
    assert len(verdict.tokens) == 1 and len(calls) == 2


# chunked prefill -----------------------------------------------------------------------------------------

LONG = [(3 * i + 1) % (VOCAB - 1) for i in range(40)]  # 39 tokens to prefill


def spy_steps(monkeypatch, runner) -> list[tuple[int, list[int | None], int]]:
    """Record every runner.step: (decode sequences, prefill chunks' max_tokens, positions computed)."""
    calls = []
    real = runner.step

    def step(seqs, extra=None, num_logits=None, prefill=()):
        out = real(seqs, extra, num_logits, prefill)
        calls.append((len(seqs), [c.max_tokens for c in prefill], out.tokens))
        return out

    monkeypatch.setattr(runner, "step", step)
    return calls


async def decode_and_open(scheduler, decoding: list[tuple[Session, RejectionInput]], opening: list[Session]):
    """Queue the decode steps and the openings before the first tick, start, and wait for all of them."""
    steps = [asyncio.create_task(scheduler.submit(s, b)) for s, b in decoding]
    opens = [asyncio.create_task(scheduler.prefill(s)) for s in opening]
    await asyncio.sleep(0)
    scheduler.start()
    return await asyncio.gather(*steps), await asyncio.gather(*opens)


def test_a_prefill_chunk_and_decode_blocks_share_one_forward(model, batched, monkeypatch):
    a, b = make_session(batched, "a", PROMPTS[0]), make_session(batched, "b", PROMPTS[1])
    c = fresh_session(batched, "c", LONG)
    truth = reference(model, PROMPTS[0], 2)
    calls = spy_steps(monkeypatch, batched)

    async def body(scheduler):
        return await decode_and_open(scheduler, [(a, block(a, truth[:1])), (b, block(b))], [c])

    (verdicts, opened), stats = run(body, batched, start_first=False)
    assert calls == [(2, [512 - 3], 3 + 39)]  # ONE pass: both blocks and the whole prompt
    assert stats.forwards == 1 and stats.batches == 1 and stats.mixed_batches == 1
    assert stats.prefill_chunks == 1 and stats.prefill_tokens == 39
    assert opened == [(0, 1)]  # nothing was cached; one chunk
    assert [v.load.batch_size for v in verdicts] == [2, 2]
    assert [v.load.batch_tokens for v in verdicts] == [42, 42]  # positions of the pass, the prefill's included
    assert verdicts[0].tokens == truth and verdicts[1].tokens == reference(model, PROMPTS[1], 1)
    assert c.seq.num_cached == len(LONG) - 1

    async def rest(scheduler):  # the prefilled session decodes the target's own continuation
        out = []
        for _ in range(3):
            out += (await scheduler.submit(c, block(c))).tokens
        return out

    out, _ = run(rest, batched)
    assert out == reference(model, LONG, 3)


@pytest.mark.parametrize(
    "budget,chunk_cap,first_pass,passes",
    [
        (16, 0, (1, [12], 16), [(0, [16], 16), (0, [16], 11)]),  # blocks first, the prompt fills the rest
        (512, 5, (1, [5], 9), [(0, [5], 5)] * 6 + [(0, [5], 4)]),  # each pass at most prefill_chunk_tokens
        (8, 0, (1, [2], 10), [(0, [8], 8)] * 4 + [(0, [8], 5)]),  # a full budget still lets a quarter through
    ],
)
def test_the_token_budget_splits_a_prefill_across_ticks(batched, monkeypatch, budget, chunk_cap, first_pass, passes):
    a = make_session(batched, "a", PROMPTS[0])
    k = 3 if budget != 8 else 7  # the budget of 8 is used up by this block alone
    c = fresh_session(batched, "c", LONG)
    calls = spy_steps(monkeypatch, batched)

    async def body(scheduler):
        return await decode_and_open(scheduler, [(a, block(a, [1] * k))], [c])

    (verdicts, opened), stats = run(
        body, batched, start_first=False, max_batch_tokens=budget, prefill_chunk_tokens=chunk_cap
    )
    assert calls == [first_pass, *passes]
    assert verdicts[0].load.batch_tokens == first_pass[2]
    assert opened == [(0, 1 + len(passes))] and stats.prefill_tokens == 39 == c.seq.num_cached
    assert stats.forwards == 1 + len(passes) and stats.mixed_batches == stats.batches == 1


def test_sessions_opening_in_one_pass_each_get_their_own_prefix_reuse(model, batched):
    old = make_session(batched, "old", LONG[:20])  # 19 tokens cached
    turn2 = fresh_session(batched, "turn2", LONG)
    turn2.seq = old.seq  # a second turn of the same conversation: its cached prefix is reused
    turn2.seq.reset_tokens(LONG)
    new = fresh_session(batched, "new", PROMPTS[1])

    async def body(scheduler):
        return (await decode_and_open(scheduler, [], [turn2, new]))[1]

    opened, stats = run(body, batched, start_first=False)
    assert opened == [(19, 1), (0, 1)] and stats.forwards == 1 and stats.batches == 0
    assert stats.prefill_tokens == (39 - 19) + len(PROMPTS[1]) - 1


def test_a_failing_prefill_chunk_fails_only_its_open(model, batched):
    a = make_session(batched, "a", PROMPTS[0])
    bad = fresh_session(batched, "bad", [1, 2, VOCAB + 7, 4, 5])  # the forward raises on this id

    async def body(scheduler):
        step, opening = asyncio.create_task(scheduler.submit(a, block(a))), asyncio.create_task(scheduler.prefill(bad))
        await asyncio.sleep(0)
        scheduler.start()
        return await asyncio.gather(step, opening, return_exceptions=True)

    (verdict, failed), stats = run(body, batched, start_first=False)
    assert verdict.tokens == reference(model, PROMPTS[0], 1) and verdict.load.batch_size == 1
    assert isinstance(failed, RuntimeError) and "prefill failed" in str(failed)
    assert bad.seq.num_cached == 0  # the failed pass left its cache as it was


def test_a_cancelled_open_is_dropped_before_its_pass(batched, monkeypatch):
    c = fresh_session(batched, "c", LONG)
    calls = spy_steps(monkeypatch, batched)

    async def body(scheduler):
        task = asyncio.create_task(scheduler.prefill(c))
        await asyncio.sleep(0)
        task.cancel()  # the client went away before the first tick
        scheduler.start()
        await asyncio.sleep(0.05)
        return task.cancelled()

    cancelled, stats = run(body, batched, start_first=False)
    assert cancelled and calls == [] and stats.forwards == 0 and c.seq.num_cached == 0


def test_without_a_ragged_step_prefill_runs_between_ticks(model):
    hf = ModelRunner(model)
    c = fresh_session(hf, "c", LONG)

    async def body(scheduler):
        return await scheduler.prefill(c)

    opened, stats = run(body, hf, prefill_chunk_tokens=4)
    assert opened == (0, 10)  # 39 tokens in chunks of 4
    assert stats.prefill_chunks == 10 and stats.prefill_tokens == 39 and stats.forwards == 0
    assert c.seq.num_cached == 39

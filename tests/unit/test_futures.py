"""specmesh.futures.within: a bounded wait that never loses a cancellation.

A task looping on a bounded wait (the verify scheduler's batch window, a Verify stream's next message) must
end when it is cancelled, whichever step of the wait the cancellation meets: the awaited thing still pending,
just completed, or its result on the way back. Python 3.11's asyncio.wait_for returns the result in the
latter cases and the task runs on, so whoever awaits its end (a service's shutdown) hangs.
"""

import asyncio

import pytest

from specmesh.futures import within


async def _cancel_while_woken(spins: int) -> bool:
    """Whether a task looping on `within(event.wait())` ends when cancelled `spins` loop steps after its
    event was set."""
    event = asyncio.Event()
    rounds = 0

    async def waiter():
        nonlocal rounds
        while True:
            await within(event.wait(), 10.0)
            event.clear()
            rounds += 1

    task = asyncio.create_task(waiter())
    await asyncio.sleep(0)
    event.set()
    for _ in range(spins):
        await asyncio.sleep(0)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=1.0)
    if not done:
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
    return bool(done) and task.cancelled()


@pytest.mark.parametrize("spins", range(6))
def test_a_cancellation_that_meets_a_completed_wait_still_ends_the_task(spins):
    assert asyncio.run(_cancel_while_woken(spins))


def test_it_times_out_and_returns_results():
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        with pytest.raises(TimeoutError):
            await within(queue.get(), 0.01)
        queue.put_nowait("x")
        assert await within(queue.get(), 1.0) == "x"
        queue.put_nowait("y")
        assert await within(queue.get(), None) == "y"

    asyncio.run(main())


def test_a_cancelled_queue_wait_leaves_the_item_queued():
    """A Verify stream cancelled while its next message arrives must not take the message with it."""

    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        task = asyncio.create_task(within(queue.get(), 10.0))
        await asyncio.sleep(0)
        queue.put_nowait("block")
        task.cancel()
        await asyncio.wait({task}, timeout=1.0)
        return task.cancelled(), queue.qsize()

    cancelled, left = asyncio.run(main())
    assert cancelled and left == 1

"""Answering the waiters of a batch: each future gets its own outcome, a result or the exception that
stands in for it."""

from __future__ import annotations

import asyncio
from typing import Any


def settle(future: asyncio.Future, outcome: Any) -> None:
    """Answer `future` with `outcome` (raised if it is an exception). A future already done, whose waiter gave
    up (cancelled) or was answered otherwise, is left as it is."""
    if future.done():
        return
    if isinstance(outcome, BaseException):
        future.set_exception(outcome)
    else:
        future.set_result(outcome)


async def within(awaitable: Any, timeout: float | None) -> Any:
    """Await `awaitable` for at most `timeout` seconds (None: no limit), raising TimeoutError past it.

    Not `asyncio.wait_for`: on Python 3.11 it returns the result when a cancellation arrives as the awaited
    thing completes, and the cancelled task runs on; a loop awaiting it (a scheduler waiting for work, a
    stream waiting for its next message) then never ends, and whoever awaits its end hangs."""
    async with asyncio.timeout(timeout):
        return await awaitable

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

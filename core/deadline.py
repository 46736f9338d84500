"""A time limit on the operator's code (reward functions, tools): one that hangs, say a judge over HTTP that never
answers, must fail, not hold its group in flight for good (the rollout worker renews the lease of a group it works
on)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


class Overdue(TimeoutError):
    """Operator code (a reward function, a tool) gave no answer within its limit and was cancelled."""


async def within(limit_s: float, awaitable: Awaitable[T]) -> T:
    """``await awaitable``, cancelled after ``limit_s`` with ``Overdue``: operator code that hangs must fail, not
    hold its group in flight forever. A TimeoutError of the code's own (its HTTP client's) passes through as it is,
    so the error never claims a limit that was not reached."""
    deadline = asyncio.timeout(limit_s)
    try:
        async with deadline:
            return await awaitable
    except TimeoutError:
        if deadline.expired():
            raise Overdue(f"no answer within {limit_s:g}s") from None
        raise

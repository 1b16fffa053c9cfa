"""Running coroutines together where the first failure ends them all: asyncio.TaskGroup's rule, which needs Python
3.11, for the Pythons hpc runs on (3.10 and later)."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Iterable


async def all_or_first_failure(awaitables: Iterable[Awaitable[Any]]) -> list[Any]:
    """Their results in order; the first exception cancels the others (awaited, so none outlives the call) and is
    raised as it is, not wrapped in a group."""
    tasks = [asyncio.ensure_future(a) for a in awaitables]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise

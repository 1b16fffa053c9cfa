"""Coroutines run together, the first failure ending them all (asyncio.TaskGroup's rule, on Python 3.10 too)."""

from __future__ import annotations

import asyncio

import pytest

from hpc.runtime.serve.tasks import all_or_first_failure

pytestmark = pytest.mark.unit


def test_results_come_in_order_and_the_first_failure_cancels_the_rest_and_is_raised_as_is():
    cancelled = []

    async def slow(i: int) -> int:
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        return i

    async def fails() -> None:
        await asyncio.sleep(0.01)
        raise KeyError("sample 1")

    async def quick(i: int) -> int:
        await asyncio.sleep(0.001 * (3 - i))
        return i

    async def main():
        assert await all_or_first_failure(quick(i) for i in range(3)) == [0, 1, 2]
        with pytest.raises(KeyError, match="sample 1"):  # not an ExceptionGroup
            await all_or_first_failure([slow(0), fails(), slow(2)])
        return cancelled
    assert sorted(asyncio.run(main())) == [0, 2]  # both others cancelled before the call returned

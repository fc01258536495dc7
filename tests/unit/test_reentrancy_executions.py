"""What one execution is, for reentrant acquires: a thread, or an asyncio task on it."""

from __future__ import annotations

import asyncio
import threading

from coordination import locks


def test_each_asyncio_task_and_each_thread_is_an_execution_of_its_own() -> None:
    outside = locks._execution()

    async def main() -> tuple[tuple[int, int], tuple[int, int], tuple[int, int]]:
        here = locks._execution()

        async def child() -> tuple[int, int]:
            return locks._execution()

        first, second = await asyncio.gather(child(), child())
        assert first != second
        return here, first, second

    here, first, second = asyncio.run(main())
    assert len({outside, here, first, second}) == 4
    assert locks._execution() == outside  # the same thread, no task: the same execution

    other: list[tuple[int, int]] = []
    thread = threading.Thread(target=lambda: other.append(locks._execution()))
    thread.start()
    thread.join()
    assert other[0] != outside

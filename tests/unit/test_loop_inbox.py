"""router.frontdoor.loop_inbox: items from threads reach their queues on the loop, in order,
with one loop wake-up per burst."""

from __future__ import annotations

import asyncio
import threading

import pytest

from router.frontdoor.loop_inbox import LoopInbox


def test_a_burst_is_one_wake_up_and_keeps_each_threads_order():
    loop = asyncio.new_event_loop()
    try:
        inbox = LoopInbox(loop)
        wakes = []
        original = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakes.append(callback)
            return original(callback, *args)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        queues = [asyncio.Queue() for _ in range(4)]
        threads = [threading.Thread(target=lambda q=q: [inbox.put(q, i) for i in range(50)])
                   for q in queues]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        assert len(wakes) == 1  # the loop did not run meanwhile: every item waits for one

        async def drain(queue: asyncio.Queue) -> list[int]:
            return [await asyncio.wait_for(queue.get(), 5) for _ in range(50)]

        async def drain_all() -> list[list[int]]:
            return list(await asyncio.gather(*(drain(q) for q in queues)))

        got = loop.run_until_complete(drain_all())
        assert got == [list(range(50))] * 4
        assert all(q.empty() for q in queues)
        inbox.put(queues[0], "again")  # delivered: the next item wakes the loop again
        assert len(wakes) == 2
        assert loop.run_until_complete(asyncio.wait_for(queues[0].get(), 5)) == "again"
    finally:
        loop.close()


def test_items_from_a_thread_reach_a_running_loop():
    loop = asyncio.new_event_loop()
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        inbox = LoopInbox(loop)

        async def make() -> asyncio.Queue:
            return asyncio.Queue()

        queue = asyncio.run_coroutine_threadsafe(make(), loop).result(5)
        senders = [threading.Thread(target=lambda k=k: [inbox.put(queue, (k, i))
                                                          for i in range(200)])
                   for k in range(3)]
        for sender in senders:
            sender.start()

        async def take() -> list:
            return [await asyncio.wait_for(queue.get(), 5) for _ in range(600)]

        got = asyncio.run_coroutine_threadsafe(take(), loop).result(20)
        for k in range(3):
            assert [i for who, i in got if who == k] == list(range(200))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        runner.join(5)
        loop.close()


def test_a_closed_loop_raises_and_keeps_nothing():
    loop = asyncio.new_event_loop()
    loop.close()
    inbox = LoopInbox(loop)
    queue: asyncio.Queue = asyncio.Queue()
    with pytest.raises(RuntimeError):
        inbox.put(queue, 1)
    with pytest.raises(RuntimeError):  # not swallowed as "a wake-up is on its way"
        inbox.put(queue, 2)

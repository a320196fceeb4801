"""Items handed from threads to queues on one asyncio event loop, one wake-up per burst.

Each HTTP request's responses come from a thread of its own (router.frontdoor.http_api), and
after a decode step every running request has a token at about the same time. Handing each one
over with `call_soon_threadsafe` writes to the loop's wake-up socket and runs one callback per
item; here the items wait in one list and the loop takes all of them in one callback, woken
only by the first item that finds the list empty."""

from __future__ import annotations

import asyncio
import threading


class LoopInbox:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def put(self, queue: asyncio.Queue, item: object) -> None:
        """Put `item` on `queue` (a queue of this inbox's loop) from any thread, the order of
        one thread's items kept. RuntimeError once the loop is closed, as
        call_soon_threadsafe raises."""
        with self._lock:
            self._pending.append((queue, item))
            if len(self._pending) > 1:  # a wake-up is on its way and will take this too
                return
        try:
            self._loop.call_soon_threadsafe(self._deliver)
        except RuntimeError:
            with self._lock:
                self._pending.clear()
            raise

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, item in pending:
            queue.put_nowait(item)

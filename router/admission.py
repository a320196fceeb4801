"""The router's bounded queue: at most `max_running` requests are being served at once; up to
`max_queued` more wait, first come first served, for a slot; beyond that a request is refused at
once (the servicer answers RESOURCE_EXHAUSTED). A queued request whose deadline passes or whose
client cancels leaves the queue without ever reaching a worker. Plain Python."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable


class QueueFull(Exception):
    pass


class LeftQueue(Exception):
    """The request left the queue before a slot freed: `reason` is "deadline" or "cancelled"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


class Admission:
    def __init__(self, max_running: int, max_queued: int,
                 clock: Callable[[], float] = time.monotonic):
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"max_running must be >= 1 and max_queued >= 0, got "
                             f"{max_running} and {max_queued}")
        self.max_running = max_running
        self.max_queued = max_queued
        self._clock = clock
        self._running = 0
        self._queue: deque[object] = deque()
        self._changed = threading.Condition()

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    def enter(self, deadline: float, cancelled: threading.Event, poll_s: float = 0.05) -> None:
        """Take a slot, waiting in line if needed. QueueFull when the line is full; LeftQueue
        when the deadline (a `clock` time) passes or `cancelled` is set while waiting."""
        ticket = object()
        with self._changed:
            if not self._queue and self._running < self.max_running:
                self._running += 1
                return
            if len(self._queue) >= self.max_queued:
                raise QueueFull(f"{self._running} requests running and {len(self._queue)} "
                                f"queued; the router's limits are {self.max_running} running "
                                f"(--max-running) and {self.max_queued} queued (--max-queued)")
            self._queue.append(ticket)
            try:
                while not (self._queue[0] is ticket and self._running < self.max_running):
                    if cancelled.is_set():
                        raise LeftQueue("cancelled")
                    left = deadline - self._clock()
                    if left <= 0:
                        raise LeftQueue("deadline")
                    self._changed.wait(min(left, poll_s))
                self._running += 1
            finally:
                self._queue.remove(ticket)
                self._changed.notify_all()

    def leave(self) -> None:
        """Give the slot back (every `enter` that returned must be matched by one `leave`)."""
        with self._changed:
            self._running -= 1
            self._changed.notify_all()

    def idle(self) -> bool:
        with self._changed:
            return self._running == 0 and not self._queue

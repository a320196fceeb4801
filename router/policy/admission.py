"""The router's bounded queue: at most `max_running` requests are being served at once; up to
`max_queued` more wait for a slot; beyond that a request is refused at once (the servicer answers
RESOURCE_EXHAUSTED). A queued request whose deadline passes or whose client cancels leaves the
queue without ever reaching a worker. Plain Python.

Which waiting request takes a freed slot: `fcfs`, the oldest; `short_first` (the default), the one
with the fewest prompt tokens — a chat turn does not wait behind documents — unless some request
has waited longer than `age_bound_s`: then the oldest of those, so nothing starves."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass


class QueueFull(Exception):
    pass


class LeftQueue(Exception):
    """The request left the queue before a slot freed: `reason` is "deadline" or "cancelled"."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


QUEUE_POLICIES = ("fcfs", "short_first")


@dataclass(frozen=True, eq=False)  # compared by identity: two waiters are never the same
class Ticket:
    cost: int  # prompt tokens
    since: float


class Admission:
    def __init__(self, max_running: int, max_queued: int,
                 clock: Callable[[], float] = time.monotonic, policy: str = "short_first",
                 age_bound_s: float = 4.0):
        if max_running < 1 or max_queued < 0:
            raise ValueError(f"max_running must be >= 1 and max_queued >= 0, got "
                             f"{max_running} and {max_queued}")
        if policy not in QUEUE_POLICIES:
            raise ValueError(f"--queue-policy must be one of {', '.join(QUEUE_POLICIES)}, got "
                             f"{policy!r}")
        if not age_bound_s > 0:
            raise ValueError(f"--queue-age-bound-s must be > 0, got {age_bound_s}")
        self.max_running = max_running
        self.max_queued = max_queued
        self.policy = policy
        self.age_bound_s = age_bound_s
        self._clock = clock
        self._running = 0
        self._queue: deque[Ticket] = deque()  # in arrival order
        self._changed = threading.Condition()

    @property
    def running(self) -> int:
        return self._running

    @property
    def queued(self) -> int:
        return len(self._queue)

    def enter(self, deadline: float, cancelled: threading.Event, poll_s: float = 0.05,
              cost: int = 0) -> None:
        """Take a slot, waiting in line if needed (`cost`: the request's prompt tokens). QueueFull
        when the line is full; LeftQueue when the deadline (a `clock` time) passes or `cancelled`
        is set while waiting."""
        ticket = Ticket(cost, self._clock())
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
                while not (self._next() is ticket and self._running < self.max_running):
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

    def _next(self) -> Ticket:
        """The waiting request the next free slot goes to (the queue is not empty)."""
        oldest = self._queue[0]
        if self.policy == "fcfs" or self._clock() - oldest.since > self.age_bound_s:
            return oldest
        return min(self._queue, key=lambda t: (t.cost, t.since))

    def leave(self) -> None:
        """Give the slot back (every `enter` that returned must be matched by one `leave`)."""
        with self._changed:
            self._running -= 1
            self._changed.notify_all()

    def idle(self) -> bool:
        with self._changed:
            return self._running == 0 and not self._queue

"""The decode streams this router is reading now, by worker: what a drain or a rebalance may
pause to move (router.policy.moves chooses, router.request.move_trigger asks the workers, and the
request's own orchestrator thread moves it when its stream says it paused). Thread-safe plain
Python."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from router.policy.moves import LiveStream

REFUSED_BACKOFF_S = 2.0  # a stream its worker would not pause is not asked again this soon


class LiveStreams:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._streams: dict[str, LiveStream] = {}
        self._lock = threading.Lock()

    def open(self, stream: LiveStream) -> None:
        with self._lock:
            self._streams[stream.request_id] = stream

    def close(self, request_id: str) -> str:
        """The stream ended (finished, failed or paused); the cause of the move asked of it."""
        with self._lock:
            stream = self._streams.pop(request_id, None)
        return "" if stream is None else stream.cause

    def grow(self, request_id: str, tokens: int) -> None:
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.tokens += tokens
                stream.remaining -= tokens

    def snapshot(self) -> list[LiveStream]:
        """Copies of the streams that could be asked to move now."""
        now = self._clock()
        with self._lock:
            return [dataclasses.replace(s) for s in self._streams.values()
                    if s.movable and not s.cause and s.not_before <= now]

    def ask(self, request_id: str, cause: str) -> bool:
        """Mark a move asked of the stream; False when it ended or was asked already."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or stream.cause:
                return False
            stream.cause = cause
            return True

    def refused(self, request_id: str) -> None:
        """Its worker would not pause it (not now, or never): ask again later."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.cause = ""
                stream.not_before = self._clock() + REFUSED_BACKOFF_S

    def count(self, worker_id: str) -> int:
        with self._lock:
            return sum(1 for s in self._streams.values() if s.worker_id == worker_id)

"""Where a request's outputs go when they leave the step loop.

A `QueueSink` feeds one Decode stream: its handler thread wakes for every token. A `SessionSink`
feeds the router's Outputs stream (`OutputSession`), which carries every request the router
started with DecodeInto: the step loop appends each step's outputs and wakes the stream's sender
once per step, so a step of N running requests costs one message and one wake-up instead of N
of each (vLLM's engine core hands its front end a step's outputs the same way). The DecodeInto
handler waits for the request's end only.

Plain Python over outputs; `put` runs on the loop thread, the rest on gRPC handler threads."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from decode_worker.departures import Paused
from engine.engine import RequestOutput

STALL_TIMEOUT_S = 300.0  # no output for this long means the loop is stuck: give up
MAX_SESSION_ID = 64
Item = RequestOutput | Paused


def ends_request(item: Item) -> bool:
    """A finished or paused output: its request's last here."""
    return isinstance(item, Paused) or item.finished


class QueueSink:
    """One request's outputs for a handler thread that streams them itself."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Item | BaseException] = queue.SimpleQueue()
        self.admission_s = 0.0

    def note_admission(self, seconds: float) -> None:
        self.admission_s = seconds

    def put(self, item: Item | BaseException) -> None:
        self._queue.put(item)

    def drain(self) -> Iterator[Item]:
        """The outputs until the request finishes or is paused to move (its error raised)."""
        while True:
            try:
                item = self._queue.get(timeout=STALL_TIMEOUT_S)
            except queue.Empty:
                raise TimeoutError(f"no output for {STALL_TIMEOUT_S:.0f}s") from None
            if isinstance(item, BaseException):
                raise item
            yield item
            if ends_request(item):
                return


@dataclass
class Sent:
    """One output waiting in a session, and the sink it came from."""

    request_id: str
    item: Item
    sink: SessionSink


class SessionSink:
    """One request's outputs into its router's session; its DecodeInto handler waits for the
    end: the last chunk (finished or paused) sent, or the request failed."""

    def __init__(self, session: OutputSession, request_id: str):
        self.session = session
        self.request_id = request_id
        self.admission_s = 0.0
        self.first_sent = False  # the session's sender marks the request's first chunk
        self.paused = False
        self.error: BaseException | None = None
        self._ended = threading.Event()
        self._bound = True
        # `put` runs on the loop thread, `fail` on the sender's or the handler's: each end and
        # each unbind happens once
        self._lock = threading.Lock()
        self._last_output = time.monotonic()

    def note_admission(self, seconds: float) -> None:
        self.admission_s = seconds

    def put(self, item: Item | BaseException) -> None:
        if self._ended.is_set():
            return  # failed already (`fail`): its sender skips whatever else it queued
        self._last_output = time.monotonic()
        if isinstance(item, BaseException):
            self.fail(item)
            return
        self.paused = isinstance(item, Paused)
        if ends_request(item):
            self._unbind()  # it is over on the worker: a closing session need not abort it
            self.session.push_last(Sent(self.request_id, item, self))
        else:
            self.session.push(Sent(self.request_id, item, self))

    def delivered(self) -> None:
        """The sender handed the last chunk to the router's stream: the request has ended."""
        self.session.forget_last(self)
        with self._lock:
            self._ended.set()

    def fail(self, error: BaseException) -> None:
        """End the request with `error` (its handler raises it): the engine failed it, the
        session could not send its output, or its call ended. Nothing of it is sent after."""
        with self._lock:
            if self._ended.is_set():
                return
            self.error = error
            self._ended.set()
        self._unbind()
        self.session.forget_last(self)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def _unbind(self) -> None:
        with self._lock:
            bound, self._bound = self._bound, False
        if bound:
            self.session.unbind(self.request_id)

    def detach(self) -> None:
        """The request never started (its call was refused): forget it."""
        self._unbind()

    def wait(self) -> None:
        """Until the request ends here: returns once its last chunk was sent (it finished or
        paused); raises its error, or TimeoutError when it produced nothing for too long."""
        while not self._ended.wait(min(STALL_TIMEOUT_S, 5.0)):
            if time.monotonic() - self._last_output >= STALL_TIMEOUT_S:
                self.fail(TimeoutError(f"no output for {STALL_TIMEOUT_S:.0f}s"))
        if self.error is not None:
            raise self.error


class OutputSession:
    """One router's Outputs stream: the outputs of the requests bound to it, taken a step's
    worth at a time by the stream's sender."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self._pending: list[Sent] = []
        self._bound: set[str] = set()
        self._unsent_last: set[SessionSink] = set()  # last chunks queued, not yet sent
        self._ready = False  # a step ended (or a request did) since the sender last took
        self._closed = False
        self._cond = threading.Condition()

    def bind(self, request_id: str) -> SessionSink:
        """A request whose outputs go here (ValueError: the session has closed)."""
        with self._cond:
            if self._closed:
                raise ValueError(f"output session {self.session_id!r} has closed")
            self._bound.add(request_id)
        return SessionSink(self, request_id)

    def unbind(self, request_id: str) -> None:
        with self._cond:
            self._bound.discard(request_id)

    def push(self, sent: Sent) -> None:
        """Queue an output; the sender takes it at the step's end (`wake`)."""
        with self._cond:
            if not self._closed:  # else its request is being aborted
                self._pending.append(sent)

    def push_last(self, sent: Sent) -> None:
        """Queue a request's last output and wake the sender now; its sink ends once the
        sender sent it (`SessionSink.delivered`), or fails if the session closes first."""
        with self._cond:
            closed = self._closed
            if not closed:
                self._pending.append(sent)
                self._unsent_last.add(sent.sink)
                self._ready = True
                self._cond.notify()
        if closed:
            sent.sink.fail(_closed_before_sent(sent.request_id))

    def forget_last(self, sink: SessionSink) -> None:
        with self._cond:
            self._unsent_last.discard(sink)

    def wake(self) -> None:
        """The step's outputs are all queued: send them."""
        with self._cond:
            if self._pending:
                self._ready = True
                self._cond.notify()

    def take(self, timeout_s: float) -> list[Sent] | None:
        """What is queued once the step that queued it ended, waiting up to `timeout_s` for
        that (after which it takes what is there, [] when nothing); None once closed."""
        with self._cond:
            if not self._ready and not self._closed:
                self._cond.wait(timeout_s)
            if self._closed:
                return None
            self._ready = False
            taken, self._pending = self._pending, []
            return taken

    def close(self) -> list[str]:
        """End the session: the requests still bound to it (their router went away). A last
        chunk it never sent fails its request's wait."""
        with self._cond:
            self._closed = True
            self._pending = []
            bound, self._bound = sorted(self._bound), set()
            unsent, self._unsent_last = list(self._unsent_last), set()
            self._cond.notify_all()
        for sink in unsent:
            sink.fail(_closed_before_sent(sink.request_id))
        return bound


def _closed_before_sent(request_id: str) -> RuntimeError:
    return RuntimeError(f"the output session closed before request {request_id}'s last chunk "
                        "was sent")


class OutputSessions:
    """The open sessions of one worker, by id."""

    def __init__(self) -> None:
        self._sessions: dict[str, OutputSession] = {}
        self._lock = threading.Lock()

    def open(self, session_id: str) -> tuple[OutputSession, list[str]]:
        """A new session (ValueError on a bad id), and the requests of the one it replaces."""
        if not session_id or len(session_id) > MAX_SESSION_ID:
            raise ValueError(f"session_id must be 1 to {MAX_SESSION_ID} characters, got "
                             f"{len(session_id)}")
        session = OutputSession(session_id)
        with self._lock:
            old = self._sessions.get(session_id)
            self._sessions[session_id] = session
        return session, ([] if old is None else old.close())

    def get(self, session_id: str) -> OutputSession | None:
        with self._lock:
            return self._sessions.get(session_id)

    def close(self, session: OutputSession) -> list[str]:
        """End `session` (if still the open one by its id): the requests still bound to it."""
        with self._lock:
            if self._sessions.get(session.session_id) is session:
                del self._sessions[session.session_id]
        return session.close()

    def wake_all(self) -> None:
        """After a step's outputs were delivered: every session sends what it holds."""
        with self._lock:
            sessions = list(self._sessions.values())
        for session in sessions:
            session.wake()

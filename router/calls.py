"""One client request's deadline and cancellation, shared by every worker call made for it."""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc

DEFAULT_TIMEOUT_S = 600.0  # a client that sends no deadline still gets a bounded request
# The client's clock starts before ours, so its deadline fires (and cancels the call) a moment
# before our copy of it: a cancel this close to the deadline is the deadline.
DEADLINE_SLACK_S = 0.25


class RouterError(Exception):
    """Ends a client request with a gRPC status, unless it is `retryable` (a worker failed, not
    the request): then the orchestrator tries again without the `suspect` worker."""

    def __init__(self, code: grpc.StatusCode, message: str, retryable: bool = False,
                 worker_code: grpc.StatusCode | None = None, suspect: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.retryable = retryable
        self.worker_code = worker_code  # the status the worker answered, when one did
        self.suspect = suspect


class CallScope:
    def __init__(self, time_remaining_s: float | None):
        budget = DEFAULT_TIMEOUT_S if time_remaining_s is None else time_remaining_s
        self.deadline = time.monotonic() + budget
        self.cancelled = threading.Event()
        self._calls: list[Any] = []
        self._lock = threading.Lock()

    def expired(self) -> bool:
        """The deadline passed (gRPC also cancels the call then: that is not a client cancel)."""
        return time.monotonic() >= self.deadline - DEADLINE_SLACK_S

    def timeout(self) -> float:
        """Seconds left for the next worker call; DEADLINE_EXCEEDED once none are left."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RouterError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed")
        if self.cancelled.is_set():
            raise RouterError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
        return left

    def track(self, call: Any) -> Any:
        """Remember an in-flight call (future or stream) so a cancel can cancel it."""
        with self._lock:
            self._calls.append(call)
            if self.cancelled.is_set():
                call.cancel()
        return call

    def cancel(self) -> None:
        self.cancelled.set()
        with self._lock:
            for call in self._calls:
                call.cancel()

    def pause(self, seconds: float) -> None:
        """Wait a little before trying again (cut short by a cancel; bounded by the deadline)."""
        self.cancelled.wait(min(seconds, max(0.0, self.timeout())))
        self.timeout()  # raise if the wait ended by cancel or deadline

    def unary(self, method: Any, message: Any, what: str) -> Any:
        """Call a unary worker RPC under this scope; worker errors become RouterErrors."""
        future = self.track(method.future(message, timeout=self.timeout()))
        try:
            return future.result()
        except grpc.FutureCancelledError:
            self.timeout()  # DEADLINE_EXCEEDED if that is why the call was cancelled
            raise RouterError(grpc.StatusCode.CANCELLED,
                              "the client cancelled the request") from None
        except grpc.RpcError as exc:
            raise worker_error(exc, what, self) from exc


def worker_error(exc: grpc.RpcError, what: str, scope: CallScope) -> RouterError:
    code = exc.code()
    if code is grpc.StatusCode.DEADLINE_EXCEEDED or scope.expired():
        return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{what}: the request's deadline passed")
    if scope.cancelled.is_set() or code is grpc.StatusCode.CANCELLED:
        return RouterError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return RouterError(code, f"{what}: the request's deadline passed")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RouterError(code, f"{what}: {exc.details()}", worker_code=code)
    # The worker died, is draining, or failed the request: another worker may well succeed.
    return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what} failed: {code.name}: {exc.details()}",
                       retryable=True, worker_code=code)

"""One client request's deadline and cancellation, shared by every worker call made for it."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import grpc

DEFAULT_TIMEOUT_S = 600.0  # a client that sends no deadline gets this (--default-timeout-s)
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


class LostWorkers:
    """The calls in flight to each worker, so the router can abandon those of a worker it dropped
    for missed heartbeats. A partition is silent (no reset, no error): a call on a connection
    that went quiet would hang until the request's deadline; abandoned, its request retries or
    migrates at once."""

    def __init__(self, is_live: Callable[[str], bool] = lambda worker_id: True) -> None:
        self._is_live = is_live  # the registry still lists it
        self._calls: dict[str, set[Any]] = {}
        self._abandoned: set[Any] = set()
        self._lock = threading.Lock()

    def watch(self, worker_id: str, call: Any) -> None:
        """Watch a call; one to a worker already dropped is abandoned at once (it was placed
        from a view a moment older than the drop)."""
        with self._lock:
            if self._is_live(worker_id):
                self._calls.setdefault(worker_id, set()).add(call)
                return
            self._abandoned.add(call)
        call.cancel()

    def unwatch(self, worker_id: str, call: Any) -> None:
        with self._lock:
            self._calls.get(worker_id, set()).discard(call)
            self._abandoned.discard(call)

    def abandon(self, worker_id: str) -> int:
        """Cancel every call in flight to `worker_id`; how many there were."""
        with self._lock:
            calls = self._calls.pop(worker_id, set())
            self._abandoned |= calls
        for call in calls:
            call.cancel()
        return len(calls)

    def abandoned(self, call: Any) -> bool:
        with self._lock:
            return call in self._abandoned

    def in_flight(self, worker_id: str) -> int:
        with self._lock:
            return len(self._calls.get(worker_id, ()))


class CallScope:
    def __init__(self, budget_s: float, lost: LostWorkers | None = None):
        """`budget_s`: the seconds the request may take (common.grpc_server.call_budget_s)."""
        self.deadline = time.monotonic() + budget_s
        self.cancelled = threading.Event()
        self.lost = lost  # the router's, set by the orchestrator: calls to workers it abandons
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

    @contextmanager
    def watching(self, worker_id: str, call: Any, what: str) -> Iterator[None]:
        """Run a call to `worker_id`: if the router abandons that worker meanwhile (it missed
        its heartbeats), the call's failure becomes a retryable error naming it as suspect."""
        lost = self.lost
        if lost is None:
            yield
            return
        lost.watch(worker_id, call)
        try:
            yield
        except (RouterError, grpc.RpcError, grpc.FutureCancelledError) as exc:
            if lost.abandoned(call) and not self.cancelled.is_set():
                raise RouterError(grpc.StatusCode.UNAVAILABLE,
                                  f"{what}: worker {worker_id} missed its heartbeats (dead or cut "
                                  "off): call abandoned", retryable=True,
                                  suspect=worker_id) from exc
            raise
        finally:
            lost.unwatch(worker_id, call)

    def unary(self, method: Any, message: Any, what: str, worker_id: str) -> Any:
        """Call a unary RPC of `worker_id` under this scope; failures become RouterErrors."""
        future = self.track(method.future(message, timeout=self.timeout()))
        with self.watching(worker_id, future, what):
            try:
                return future.result()
            except grpc.FutureCancelledError:
                self.timeout()  # DEADLINE_EXCEEDED if that is why the call was cancelled
                raise RouterError(grpc.StatusCode.CANCELLED,
                                  "the client cancelled the request") from None
            except grpc.RpcError as exc:
                raise worker_error(exc, what, self) from exc


def worker_error(exc: grpc.RpcError, what: str, scope: CallScope) -> RouterError:
    """A worker call's failure as the client should see it. CANCELLED and DEADLINE_EXCEEDED
    are the client's only when it cancelled or its deadline passed: a worker answers them too
    (a server stopping cancels its calls; its own stall timeout), and then another may serve."""
    code = exc.code()
    if scope.expired():
        return RouterError(grpc.StatusCode.DEADLINE_EXCEEDED,
                           f"{what}: the request's deadline passed")
    if scope.cancelled.is_set():
        return RouterError(grpc.StatusCode.CANCELLED, "the client cancelled the request")
    if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return RouterError(code, f"{what}: {exc.details()}", worker_code=code)
    # The worker died, is draining, or failed the request: another worker may well succeed.
    return RouterError(grpc.StatusCode.UNAVAILABLE, f"{what} failed: {code.name}: {exc.details()}",
                       retryable=True, worker_code=code)

"""The router abandons the calls in flight to a worker it dropped for missed heartbeats, so a
request on a silently partitioned worker retries or migrates instead of hanging until its
deadline (router.request.calls.LostWorkers, CallScope.watching)."""

from __future__ import annotations

import threading
import time
from concurrent import futures

import grpc
import pytest

from router.request.calls import CallScope, LostWorkers, RouterError


class FakeCall:
    def __init__(self) -> None:
        self.cancelled = False

    def cancel(self) -> bool:
        self.cancelled = True
        return True


class FakeRpcError(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED

    def details(self) -> str:
        return "cancelled"


def test_abandon_cancels_the_calls_of_that_worker_only() -> None:
    lost = LostWorkers()
    a1, a2, b = FakeCall(), FakeCall(), FakeCall()
    lost.watch("a", a1)
    lost.watch("a", a2)
    lost.watch("b", b)
    assert lost.abandon("a") == 2
    assert a1.cancelled and a2.cancelled and not b.cancelled
    assert lost.abandoned(a1) and not lost.abandoned(b)
    lost.unwatch("a", a1)
    assert not lost.abandoned(a1)  # forgotten once its caller is done with it
    assert lost.in_flight("b") == 1 and lost.abandon("a") == 0


def test_a_call_to_a_worker_already_dropped_is_abandoned_at_once() -> None:
    live = {"a"}
    lost = LostWorkers(lambda worker_id: worker_id in live)
    call = FakeCall()
    lost.watch("gone", call)
    assert call.cancelled and lost.abandoned(call)


def test_watching_turns_an_abandoned_call_into_a_retryable_error_naming_the_worker() -> None:
    scope = CallScope(30.0, LostWorkers())
    call = FakeCall()
    with pytest.raises(RouterError) as info, scope.watching("decode-1", call, "decode"):
        scope.lost.abandon("decode-1")
        raise FakeRpcError()
    assert info.value.retryable and info.value.suspect == "decode-1"
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert "decode-1 missed its heartbeats" in info.value.message
    assert scope.lost.in_flight("decode-1") == 0


def test_watching_leaves_other_failures_and_client_cancels_alone() -> None:
    scope = CallScope(30.0, LostWorkers())
    with pytest.raises(FakeRpcError), scope.watching("w", FakeCall(), "prefill"):
        raise FakeRpcError()  # not abandoned: the caller's own handling applies
    call = FakeCall()
    with pytest.raises(FakeRpcError), scope.watching("w", call, "prefill"):
        scope.cancel()  # the client went away: not a worker's fault, no retry
        scope.lost.abandon("w")
        raise FakeRpcError()


def test_a_unary_call_hanging_on_a_silent_worker_is_abandoned() -> None:
    """A real gRPC call that never answers (what a partition looks like) ends at the abandon,
    not at the request's deadline."""
    release = threading.Event()

    def hang(request: bytes, context: grpc.ServicerContext) -> bytes:
        release.wait(30.0)
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "test.Silent", {"Hang": grpc.unary_unary_rpc_method_handler(hang)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            method = channel.unary_unary("/test.Silent/Hang")
            scope = CallScope(60.0, LostWorkers())
            def abandon_once_in_flight() -> None:  # not before the call is watched
                deadline = time.monotonic() + 30
                while scope.lost.in_flight("prefill-0") == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                scope.lost.abandon("prefill-0")

            threading.Thread(target=abandon_once_in_flight, daemon=True).start()
            with pytest.raises(RouterError) as info:
                scope.unary(method, b"", "prefill", "prefill-0")
            assert info.value.retryable and info.value.suspect == "prefill-0"
    finally:
        release.set()
        server.stop(None)

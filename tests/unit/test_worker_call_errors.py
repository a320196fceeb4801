"""What a failed worker call becomes for the client (router.request.calls.worker_error), and a
decode reservation that fails or is cancelled in flight is aborted on its worker
(Orchestrator._reserve): the worker may have made it while the router stopped waiting."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from engine.request import SamplingParams
from router.fleet.registry import Role, Worker
from router.frontdoor.validation import Job
from router.policy.placement import Charge
from router.request.calls import CallScope, RouterError, worker_error
from router.request.orchestrator import Orchestrator


class WorkerFailed(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode):
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return f"the worker said {self._code.name}"


@pytest.mark.parametrize("code", [grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED])
def test_a_workers_own_failure_is_retryable_while_the_client_waits(code):
    """A stopping worker cancels its calls and a stalled one answers DEADLINE_EXCEEDED: neither
    is the client's cancel or deadline, so another worker may serve the request."""
    error = worker_error(WorkerFailed(code), "decode", CallScope(60.0))
    assert error.code is grpc.StatusCode.UNAVAILABLE and error.retryable
    assert error.worker_code is code


def test_the_clients_cancel_and_deadline_stay_the_clients():
    scope = CallScope(60.0)
    scope.cancel()
    error = worker_error(WorkerFailed(grpc.StatusCode.CANCELLED), "decode", scope)
    assert error.code is grpc.StatusCode.CANCELLED and not error.retryable
    expired = CallScope(0.0)
    error = worker_error(WorkerFailed(grpc.StatusCode.DEADLINE_EXCEEDED), "decode", expired)
    assert error.code is grpc.StatusCode.DEADLINE_EXCEEDED and not error.retryable


@pytest.mark.parametrize("code", [grpc.StatusCode.INVALID_ARGUMENT,
                                  grpc.StatusCode.RESOURCE_EXHAUSTED])
def test_what_the_request_itself_caused_is_not_retried(code):
    error = worker_error(WorkerFailed(code), "decode", CallScope(60.0))
    assert error.code is code and not error.retryable


class Reply:
    """A Reserve call's future whose answer is an error, or the client cancelling meanwhile."""

    def __init__(self, scope: CallScope, code: grpc.StatusCode | None):
        self.scope, self.code = scope, code

    def cancel(self) -> bool:
        return True

    def result(self):
        if self.code is None:
            self.scope.cancel()
            raise grpc.FutureCancelledError()
        raise WorkerFailed(self.code)


def reserve(code: grpc.StatusCode | None) -> tuple[pytest.ExceptionInfo | None, list, list]:
    scope = CallScope(60.0)
    aborted: list[tuple[str, str, str]] = []
    released: list[Charge] = []
    orchestrator = Orchestrator.__new__(Orchestrator)
    orchestrator.stubs = SimpleNamespace(
        decode=lambda worker: SimpleNamespace(Reserve=SimpleNamespace(
            future=lambda message, timeout: Reply(scope, code))),
        abort=lambda worker, kind, rid: aborted.append((worker.worker_id, kind, rid)))
    orchestrator.lease_s = 30.0
    orchestrator.placement = SimpleNamespace(release=released.append)
    decode = Worker("decode-0", Role.DECODE, "127.0.0.1:1", 16, 4096)
    job = Job("r", "r#1", [1, 2, 3], SamplingParams(max_tokens=4))
    holders: list = []
    try:
        assert orchestrator._reserve(job, scope, decode, Charge("decode-0"), holders) is None
        return None, aborted, holders
    except RouterError as exc:
        assert released == [Charge("decode-0")]
        return exc, aborted, holders


@pytest.mark.parametrize("code", [None, grpc.StatusCode.UNAVAILABLE,
                                  grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_reserve_that_failed_in_flight_is_aborted_on_its_worker(code, monkeypatch):
    monkeypatch.setattr("router.request.orchestrator.PLACEMENT_POLL_S", 0.0)
    error, aborted, holders = reserve(code)
    assert error is not None and error.suspect == "decode-0"
    assert aborted == [("decode-0", "decode", "r#1")] and holders == []


def test_a_reserve_refused_for_room_made_nothing_to_abort(monkeypatch):
    monkeypatch.setattr("router.request.orchestrator.PLACEMENT_POLL_S", 0.0)
    error, aborted, holders = reserve(grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert error is None and aborted == [] and holders == []


class OpeningMux:
    """An Outputs stream still opening."""

    def __init__(self) -> None:
        self.closed = False

    def attach(self, timeout_s: float) -> bool:
        return False

    def close(self) -> None:
        self.closed = True


def test_a_request_out_of_time_leaves_an_opening_stream_to_the_others():
    from router.request.worker_client import WorkerStubs

    stubs, mux = WorkerStubs(), OpeningMux()
    stubs._mux = lambda worker: mux  # type: ignore[method-assign]
    decode = Worker("decode-0", Role.DECODE, "127.0.0.1:1", 16, 4096)
    with pytest.raises(RouterError) as info:
        stubs.decode_stream(decode, None, 0.05)  # type: ignore[arg-type]
    assert info.value.code is grpc.StatusCode.DEADLINE_EXCEEDED and not mux.closed
    with pytest.raises(RouterError) as info:  # its full wait: the stream is at fault
        stubs.decode_stream(decode, None, 60.0)  # type: ignore[arg-type]
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and info.value.retryable
    assert mux.closed and info.value.suspect == "decode-0"

"""A worker's servicers when its step loop does not take a command in time, or the call ended
while it waited: the caller gets UNAVAILABLE naming the method (not an unknown error), and an
abort queued behind the late command undoes what it leaves, so no reservation or request stays
held with nobody to free it. Model-free: stub workers, a stub call context."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from decode_worker.service import DecodeWorkerServicer
from pdserve_proto import pdserve_pb2 as pb
from prefill_worker.service import PrefillWorkerServicer


class Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


class Context:
    def __init__(self, active: bool = True):
        self.active = active
        self.callbacks: list = []

    def abort(self, code: grpc.StatusCode, message: str) -> None:
        raise Aborted(code, message)

    def is_active(self) -> bool:
        return self.active

    def add_callback(self, callback) -> bool:
        if not self.active:
            return False
        self.callbacks.append(callback)
        return True

    def time_remaining(self) -> float | None:
        return None


def late(*args, **kwargs):
    raise TimeoutError()


class StubWorker:
    def __init__(self) -> None:
        self.aborted_later: list[str] = []
        self.gate = SimpleNamespace(check_new=lambda context, method: None,
                                    reject=self._reject)
        self.reserve = self.abort = self.pause = late
        self.start_admitted = late

    @staticmethod
    def _reject(context, method, code, message):
        context.abort(code, message)

    def abort_later(self, request_id: str) -> None:
        self.aborted_later.append(request_id)


def reserve_request() -> pb.ReserveRequest:
    return pb.ReserveRequest(request_id="r#1", prompt_token_ids=[1, 2, 3], lease_s=30.0)


@pytest.mark.parametrize("method", ["Reserve", "Abort"])
def test_a_late_loop_is_unavailable_and_what_it_leaves_is_aborted(method):
    worker = StubWorker()
    servicer = DecodeWorkerServicer(worker)  # type: ignore[arg-type]
    message = reserve_request() if method == "Reserve" else pb.AbortRequest(request_id="r#1")
    with pytest.raises(Aborted) as info:
        getattr(servicer, method)(message, Context())
    assert info.value.code is grpc.StatusCode.UNAVAILABLE and method in str(info.value)
    assert worker.aborted_later == ["r#1"]


def test_a_late_admission_is_unavailable_and_aborted():
    worker = StubWorker()
    servicer = DecodeWorkerServicer(worker)  # type: ignore[arg-type]
    message = pb.DecodeRequest(request_id="r#1", first_token_id=7)
    with pytest.raises(Aborted) as info:
        servicer._start(message, Context(), None, "DecodeInto")  # type: ignore[arg-type]
    assert info.value.code is grpc.StatusCode.UNAVAILABLE
    assert worker.aborted_later == ["r#1"]


def test_a_reservation_made_after_the_router_stopped_waiting_is_aborted():
    worker = StubWorker()
    transfer = SimpleNamespace(to_proto=lambda: pb.KVTransferDescriptor())
    worker.reserve = lambda *args: transfer
    servicer = DecodeWorkerServicer(worker)  # type: ignore[arg-type]
    servicer.Reserve(reserve_request(), Context(active=True))
    assert worker.aborted_later == []
    servicer.Reserve(reserve_request(), Context(active=False))
    assert worker.aborted_later == ["r#1"]


def test_a_prefill_call_that_ends_aborts_its_request_there():
    """An Abort that came before the request was queued found nothing; the call's end still
    stops it."""
    worker = StubWorker()
    worker.transfer = lambda *args: None
    worker.prefill = lambda *args: SimpleNamespace(
        first_token=5, cached_tokens=0, prefill_s=0.0, queue_s=0.0, logprobs=None,
        prompt_token_ids=[1], prompt_logprobs=None, transfer=None, finish_reason=None,
        stop_reason=None)
    servicer = PrefillWorkerServicer(worker)  # type: ignore[arg-type]
    message = pb.PrefillRequest(request_id="r#2", prompt_token_ids=[1, 2, 3])
    context = Context()
    servicer.Prefill(message, context)
    assert worker.aborted_later == []
    for callback in context.callbacks:
        callback()
    assert worker.aborted_later == ["r#2"]
    with pytest.raises(Aborted) as info:
        worker.abort = late
        servicer.Abort(pb.AbortRequest(request_id="r#3"), Context())
    assert info.value.code is grpc.StatusCode.UNAVAILABLE

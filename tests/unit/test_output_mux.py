"""router.request.output_mux.OutputMux over a fake channel: when the router drops a worker,
every request streaming from it fails over with UNAVAILABLE, even where the worker's abort of
the request (its answer to the stream ending) would reach the DecodeInto call at once."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

import grpc
import pytest

from pdserve_proto import pdserve_pb2 as pb
from router.request.output_mux import OutputMux, StreamError


class Aborted(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.ABORTED

    def details(self) -> str:
        return "request ended: aborted"


class Future:
    """A DecodeInto call in flight."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Future], None]] = []
        self._error: grpc.RpcError | None = None
        self._cancelled = False

    def add_done_callback(self, callback: Callable[[Future], None]) -> None:
        self._callbacks.append(callback)

    def fail(self, error: grpc.RpcError) -> None:
        self._error = error
        for callback in self._callbacks:
            callback(self)

    def cancel(self) -> bool:
        self._cancelled = True
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def exception(self) -> grpc.RpcError | None:
        return self._error


class OutputsStream:
    """The Outputs stream: batches until cancelled; its cancel makes the worker abort the
    requests on it, and here their DecodeInto calls fail before `cancel` returns."""

    def __init__(self, calls: list[Future]) -> None:
        self._batches: queue.Queue[pb.OutputBatch | None] = queue.Queue()
        self._batches.put(pb.OutputBatch())  # the worker opened the session
        self._calls = calls

    def __iter__(self) -> OutputsStream:
        return self

    def __next__(self) -> pb.OutputBatch:
        batch = self._batches.get(timeout=30)
        if batch is None:
            raise StopIteration
        return batch

    def send(self, request_id: str, *ids: int) -> None:
        chunk = pb.TokenChunk(token_ids=list(ids))
        self._batches.put(pb.OutputBatch(chunks=[pb.RequestChunk(request_id=request_id,
                                                                 chunk=chunk)]))

    def end(self) -> None:
        """The worker ends the stream."""
        self._batches.put(None)

    def cancel(self) -> None:
        for call in self._calls:
            call.fail(Aborted())
        self.end()


class Channel:
    """What DecodeWorkerStub asks of a channel, with Outputs and DecodeInto faked."""

    def __init__(self) -> None:
        self.calls: list[Future] = []
        self.stream = OutputsStream(self.calls)

    def unary_unary(self, path: str, **_: Any) -> Any:
        return Multicallable(self) if path.endswith("/DecodeInto") else None

    def unary_stream(self, path: str, **_: Any) -> Any:
        return (lambda request, **kw: self.stream) if path.endswith("/Outputs") else None

    def stream_unary(self, path: str, **_: Any) -> None:
        return None

    def stream_stream(self, path: str, **_: Any) -> None:
        return None


class Multicallable:
    def __init__(self, channel: Channel) -> None:
        self._channel = channel

    def future(self, message: pb.DecodeRequest, timeout: float) -> Future:
        call = Future()
        self._channel.calls.append(call)
        return call


def test_closing_the_stream_fails_its_requests_over_before_the_workers_aborts_arrive():
    channel = Channel()
    mux = OutputMux(channel, "decode-0")  # type: ignore[arg-type]
    assert mux.attach(30)
    calls = [mux.open(pb.DecodeRequest(request_id=f"r{i}"), time.monotonic() + 60)
             for i in range(2)]
    channel.stream.send("r0", 7)
    assert list(next(calls[0]).token_ids) == [7]
    mux.close()
    for call in calls:
        with pytest.raises(StreamError) as failed:
            next(call)
        assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
        assert "closed by the router" in failed.value.details()
    assert mux.closed
    with pytest.raises(StreamError):
        mux.open(pb.DecodeRequest(request_id="r2"), time.monotonic() + 60)


def test_a_stream_that_ends_by_itself_fails_its_requests_over():
    channel = Channel()
    mux = OutputMux(channel, "decode-0")  # type: ignore[arg-type]
    assert mux.attach(30)
    call = mux.open(pb.DecodeRequest(request_id="r0"), time.monotonic() + 60)
    channel.stream.end()
    with pytest.raises(StreamError) as failed:
        next(call)
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    assert "ended" in failed.value.details()

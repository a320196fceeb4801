"""The decode streams of one worker over a single Outputs stream.

Each decode worker sends this router one message per step carrying every request's new tokens
(DecodeWorker.Outputs), in place of one message per request and token: with N requests
running, a step costs each process one receive and one thread wake-up instead of N. A request
is started with DecodeInto, a unary call that ends when the request does (its cancel aborts the
request on the worker, as cancelling a Decode stream does); `MuxedDecode` reads its chunks off
the shared stream and is iterated, cancelled and failed as a Decode stream is, so the rest of the
router reads both the same way."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from typing import Any

import grpc

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.request.stream_driver import WAITING, Park, StreamDriver, Waiting, current_driver

log = logging.getLogger(__name__)
ATTACH_TIMEOUT_S = 5.0  # the worker answers an Outputs call with an empty message at once


class StreamError(grpc.RpcError):
    """A muxed decode stream's failure, with a status as a failed gRPC call has one."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class MuxedDecode:
    """One request's chunks, read off its worker's Outputs stream until the one that finishes or
    pauses it; raises what ended it otherwise (its DecodeInto call's error, the stream's loss,
    its deadline, a cancel).

    Read by a thread, `next` waits for the next chunk. Read under a StreamDriver
    (router.request.stream_driver) it answers WAITING instead, the driver parks it, and the
    next item resumes the driver: a token chunk on the reader thread that brought it, anything
    else on a thread. A parked stream has no timer: its DecodeInto call carries the request's
    deadline, and that call's failure resumes it; but a last chunk lost after DecodeInto
    answered would leave it parked, so whoever drives it also ends the request at its deadline
    (the HTTP front door does)."""

    def __init__(self, mux: OutputMux, request_id: str, deadline: float):
        self._mux = mux
        self.request_id = request_id
        self._deadline = deadline  # time.monotonic()'s
        self._items: deque[pb.TokenChunk | grpc.RpcError] = deque()
        self._ready = threading.Condition()
        self._parked: StreamDriver | None = None
        self._future: Any = None
        self._ended = False

    def start(self, message: pb.DecodeRequest) -> None:
        future = self._mux.stub.DecodeInto.future(message, timeout=self._left())
        self._future = future
        future.add_done_callback(self._call_ended)

    def _left(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def _call_ended(self, future: Any) -> None:
        if future.cancelled():
            self.fail(StreamError(grpc.StatusCode.CANCELLED, "decode call cancelled"))
            return
        error = future.exception()
        if error is not None:  # on success the last chunk comes on the stream
            self.fail(error)

    def put(self, chunk: pb.TokenChunk) -> None:
        """A chunk from the Outputs stream (its reader thread)."""
        self._push(chunk, inline=_streams_on(chunk))

    def fail(self, error: grpc.RpcError) -> None:
        self._push(error, inline=False)

    def _push(self, item: pb.TokenChunk | grpc.RpcError, inline: bool) -> None:
        with self._ready:
            self._items.append(item)
            driver, self._parked = self._parked, None
            if driver is None:
                self._ready.notify()
                return
        driver.resume(inline)

    def park(self, driver: StreamDriver) -> Park:
        """After answering WAITING to `driver` (its generator is suspended now)."""
        with self._ready:
            if not self._items:
                self._parked = driver
                return Park.PARKED
            if driver.inline and not _streams_on(self._items[0]):
                return Park.ON_A_THREAD
            return Park.READY

    def cancel(self) -> bool:
        self._mux.forget(self)
        self.fail(StreamError(grpc.StatusCode.CANCELLED, "decode stream cancelled"))
        if self._future is not None:
            self._future.cancel()
        return True

    def __iter__(self) -> MuxedDecode:
        return self

    def __next__(self) -> pb.TokenChunk | Waiting:
        if self._ended:
            raise StopIteration
        item = self._next_item()
        if item is WAITING:
            return WAITING
        if isinstance(item, grpc.RpcError):
            self._end()
            if self._future is not None:
                self._future.cancel()  # the worker aborts the request
            raise item
        if item.paused or item.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
            self._end()
        return item

    def _next_item(self) -> pb.TokenChunk | grpc.RpcError | Waiting:
        driver = current_driver()
        with self._ready:
            if driver is not None:
                if not self._items or (driver.inline and not _streams_on(self._items[0])):
                    driver.waiting_on = self
                    return WAITING
                return self._items.popleft()
            while not self._items:
                left = self._left()
                if left <= 0 or not self._ready.wait(left) and not self._items:
                    return StreamError(grpc.StatusCode.DEADLINE_EXCEEDED, "the request's "
                                       "deadline passed")
            return self._items.popleft()

    def _end(self) -> None:
        self._ended = True
        self._mux.forget(self)


def _streams_on(item: pb.TokenChunk | grpc.RpcError) -> bool:
    """A chunk whose handling cannot block: tokens, with no finish and no pause."""
    return (isinstance(item, pb.TokenChunk) and not item.paused
            and item.finish_reason == pb.FINISH_REASON_UNSPECIFIED)


class OutputMux:
    """This router's Outputs stream from one decode worker, and the requests reading it."""

    def __init__(self, channel: grpc.Channel, worker_id: str):
        self.stub = pb_grpc.DecodeWorkerStub(channel)
        self.worker_id = worker_id
        self.session_id = uuid.uuid4().hex
        self.closed = False
        self._calls: dict[str, MuxedDecode] = {}
        self._lock = threading.Lock()
        self._attached = threading.Event()
        # No deadline: it lives as long as the worker does. A worker that dies resets it; one
        # the router drops for missed heartbeats has it cancelled (`close`).
        self._stream = self.stub.Outputs(pb.OutputsRequest(session_id=self.session_id))
        threading.Thread(target=self._read, name=f"outputs-{worker_id}", daemon=True).start()

    def attach(self, timeout_s: float) -> bool:
        """Wait until the worker opened the session (False: it did not within `timeout_s`, or
        the stream failed first). Every request that finds the stream opening waits on it."""
        return self._attached.wait(timeout_s) and not self.closed

    def open(self, message: pb.DecodeRequest, deadline: float) -> MuxedDecode:
        """Start the request on the worker (DecodeInto), its chunks read from this stream
        until `deadline` (time.monotonic()'s)."""
        request_id = message.request_id
        call = MuxedDecode(self, request_id, deadline)
        with self._lock:
            if self.closed:
                raise StreamError(grpc.StatusCode.UNAVAILABLE, f"the Outputs stream of worker "
                                  f"{self.worker_id} has ended")
            if request_id in self._calls:
                raise StreamError(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"request {request_id} is already streaming here")
            self._calls[request_id] = call
        message.output_session = self.session_id
        try:
            call.start(message)
        except BaseException:
            self.forget(call)
            raise
        return call

    def forget(self, call: MuxedDecode) -> None:
        with self._lock:
            if self._calls.get(call.request_id) is call:
                del self._calls[call.request_id]

    def close(self) -> None:
        """Stop reading: what still streams here fails over (UNAVAILABLE) now, before the
        worker, seeing the stream end, aborts those requests and their DecodeInto calls answer
        ABORTED, which would read as the request's own failure."""
        self._fail_all("was closed by the router")

    def _read(self) -> None:
        reason = "ended"
        try:
            for batch in self._stream:
                self._attached.set()
                for part in batch.chunks:
                    with self._lock:
                        call = self._calls.get(part.request_id)
                    if call is not None:
                        call.put(part.chunk)
        except grpc.RpcError as exc:
            reason = f"failed: {exc.code().name}: {exc.details()}"
        except Exception as exc:  # noqa: BLE001 - whatever stops the reader fails its requests
            log.exception("reading the Outputs stream of worker %s failed", self.worker_id)
            reason = f"failed: {exc!r}"
        finally:
            self._fail_all(reason)

    def _fail_all(self, reason: str) -> None:
        with self._lock:
            self.closed = True
            calls, self._calls = list(self._calls.values()), {}
        self._attached.set()  # an `attach` waiting sees the failure at once
        if calls:
            log.warning("the Outputs stream of worker %s %s; %d requests on it fail over",
                        self.worker_id, reason, len(calls))
        for call in calls:  # first: each call's first error is this one
            call.fail(StreamError(grpc.StatusCode.UNAVAILABLE,
                                  f"the Outputs stream of worker {self.worker_id} {reason}"))
        self._stream.cancel()  # a no-op once it ended; else the worker aborts what is left

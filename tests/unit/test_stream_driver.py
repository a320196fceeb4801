"""router.request.stream_driver over router.request.output_mux.MuxedDecode, without gRPC or a
model: while a driven request's stream is empty no thread waits for it; a token chunk resumes
it on the thread that hands the chunk over; a finish, a failure or a cancel resumes it on a
thread of its own; an item that comes while it parks is read at once."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pdserve_proto import pdserve_pb2 as pb
from router.request.output_mux import MuxedDecode, StreamError
from router.request.stream_driver import WAITING, Park, StreamDriver, Waiting


class NoMux:
    """What a MuxedDecode needs of its mux when nothing starts a DecodeInto call."""

    def forget(self, call: MuxedDecode) -> None:
        self.forgotten = call


def tokens(*ids: int) -> pb.TokenChunk:
    return pb.TokenChunk(token_ids=list(ids))


def last(*ids: int) -> pb.TokenChunk:
    return pb.TokenChunk(token_ids=list(ids), finish_reason=pb.FINISH_REASON_LENGTH)


class Recorded:
    """A driven reading of one stream: what was delivered, on which thread, and how it ended."""

    def __init__(self, call: MuxedDecode):
        self.call = call
        self.items: list[tuple[list[int], str]] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.cleaned_up = False
        self.driver = StreamDriver(self._responses(), self._deliver, self._end, "driven")

    def _responses(self) -> Iterator[list[int] | Waiting]:
        try:
            for chunk in self.call:
                yield WAITING if chunk is WAITING else list(chunk.token_ids)
        finally:
            self.cleaned_up = True
            self.cleanup_thread = threading.current_thread().name

    def _deliver(self, item: list[int]) -> None:
        self.items.append((item, threading.current_thread().name))

    def _end(self, error: BaseException | None) -> None:
        self.error = error
        self.ended.set()


def wait_until(check, what: str) -> None:
    deadline = time.monotonic() + 30
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def parked(call: MuxedDecode) -> bool:
    return call._parked is not None


def test_tokens_run_on_the_handing_thread_and_the_end_on_a_thread_of_its_own():
    call = MuxedDecode(NoMux(), "r1", time.monotonic() + 60)
    run = Recorded(call)
    run.driver.start()
    wait_until(lambda: parked(call), "the stream parked")  # no thread waits for it now
    here = threading.current_thread().name
    call.put(tokens(1, 2))
    assert run.items == [([1, 2], here)]  # done before put returned, on this thread
    assert parked(call)
    call.put(tokens(3))
    call.put(last(4))
    assert run.ended.wait(30)
    assert [ids for ids, _ in run.items] == [[1, 2], [3], [4]]
    assert run.items[1][1] == here and run.items[2][1] == "driven"
    assert run.error is None and run.cleaned_up


def test_a_cancel_while_parked_ends_it_on_a_thread_with_the_error():
    mux = NoMux()
    call = MuxedDecode(mux, "r2", time.monotonic() + 60)
    run = Recorded(call)
    run.driver.start()
    wait_until(lambda: parked(call), "the stream parked")
    call.put(tokens(7))
    call.cancel()
    assert run.ended.wait(30)
    assert isinstance(run.error, StreamError)
    assert run.error.code() is grpc.StatusCode.CANCELLED
    assert run.cleaned_up and mux.forgotten is call
    assert not parked(call)


def test_items_that_come_while_it_parks_are_read_at_once():
    call = MuxedDecode(NoMux(), "r3", time.monotonic() + 60)
    driver = StreamDriver(iter(()), lambda item: None, lambda error: None, "d")
    assert call.park(driver) is Park.PARKED
    call._parked = None
    call.put(tokens(1))  # not parked any more: nothing resumes, the item waits
    assert call.park(driver) is Park.READY
    driver.inline = True  # the reader thread must not run a finish: it goes to a thread
    call._items.appendleft(last(2))
    assert call.park(driver) is Park.ON_A_THREAD


def test_undriven_reading_waits_and_ends_at_the_deadline():
    call = MuxedDecode(NoMux(), "r4", time.monotonic() + 0.3)
    threading.Timer(0.05, call.put, (tokens(5),)).start()
    assert list(next(call).token_ids) == [5]  # waited for it
    with pytest.raises(StreamError) as failed:
        next(call)
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_delivery_that_fails_closes_the_responses():
    call = MuxedDecode(NoMux(), "r5", time.monotonic() + 60)
    run = Recorded(call)

    def refuse(item: list[int]) -> None:
        raise RuntimeError("the event loop is closed")

    run.driver = StreamDriver(run._responses(), refuse, run._end, "driven")
    run.driver.start()
    wait_until(lambda: parked(call), "the stream parked")
    call.put(tokens(1))  # handed over on this thread, which goes on: the cleanup runs apart
    assert run.ended.wait(30) and isinstance(run.error, RuntimeError)
    assert run.cleaned_up and run.cleanup_thread != threading.current_thread().name


def test_a_delivery_that_fails_on_its_own_thread_ends_there():
    ended: list[BaseException | None] = []
    closed = threading.Event()

    def responses() -> Iterator[int]:
        try:
            yield 1
        finally:
            closed.set()

    def refuse(item: int) -> None:
        raise RuntimeError("the event loop is closed")

    StreamDriver(responses(), refuse, ended.append, "driven").start()
    assert closed.wait(30)  # no deadlock on its own lock
    wait_until(lambda: len(ended) == 1, "its end")
    assert isinstance(ended[0], RuntimeError)

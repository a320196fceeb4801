"""A decode worker's Outputs stream over real gRPC, in one process: the worker's servicer (a
colocated worker of the tiny model) and the router's reader of it (router.request.output_mux).

Every request gets exactly its own tokens, the same as the per-request Decode stream; a step's
chunks travel in one message; ending the stream, cancelling a request or losing the worker frees
every block on the worker and fails the request over as a broken Decode stream would."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from common.convert import sampling_to_proto
from common.grpc_server import Server, channel, start_server
from decode_worker.service import SERVICE_NAMES, DecodeWorkerServicer
from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.fleet.registry import Role, Worker
from router.request.calls import CallScope, RouterError
from router.request.events import Finished, Tokens, decode_events
from router.request.output_mux import StreamError
from router.request.stream_driver import WAITING, StreamDriver
from router.request.worker_client import WorkerStubs
from serving.options import WorkerOptions

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# long enough that a driven request's own thread, however late, catches up and parks mid-stream
STREAMED = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
# long enough that four requests sent together surely run together for a while
TOGETHER = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
# still running when its test cancels, cuts or times it out: the tiny model steps in about a
# millisecond on one thread, so 400 tokens could end inside a 0.5 s deadline
LONG = SamplingParams(max_tokens=1900, temperature=0.0, ignore_eos=True)


class Served:
    """A colocated decode worker behind its gRPC servicer."""

    def __init__(self, model_dir: str):
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32",
                                        cache=CacheConfig(num_blocks=128)))
        self.worker = DecodeWorker(engine, WorkerOptions(
            role="colocated", worker_id="colocated-0", router="127.0.0.1:1", model=model_dir,
            dtype="float32"))
        self.worker.loop.start()
        self.free = self.free_blocks()
        self.server: Server = start_server(
            "127.0.0.1", 0, [lambda s: pb_grpc.add_DecodeWorkerServicer_to_server(
                DecodeWorkerServicer(self.worker), s)], SERVICE_NAMES)
        self.address = f"127.0.0.1:{self.server.port}"
        self.as_router_sees_it = Worker("colocated-0", Role.COLOCATED, self.address, 16, 2048)

    def free_blocks(self) -> int:
        return self.worker.loop.call(lambda e: e.block_manager.num_free_blocks, 10)

    def wait_all_free(self) -> None:
        wait_until(lambda: self.free_blocks() == self.free and self.worker.in_flight() == 0,
                   "every block back")

    def close(self) -> None:
        self.server.stop(0.5)
        self.worker.close()


@pytest.fixture(scope="module")
def served(tiny_llama_dir) -> Iterator[Served]:
    worker = Served(str(tiny_llama_dir))
    yield worker
    worker.close()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def decode_request(rid: str, prompt: list[int], params: SamplingParams) -> pb.DecodeRequest:
    return pb.DecodeRequest(request_id=rid, prompt_token_ids=prompt,
                            sampling=sampling_to_proto(params))


def per_request_stream(served: Served, rid: str, prompt: list[int],
                       params: SamplingParams = GREEDY) -> list[int]:
    with channel(served.address) as ch:
        chunks = pb_grpc.DecodeWorkerStub(ch).Decode(decode_request(rid, prompt, params),
                                                     timeout=60)
        return [t for chunk in chunks for t in chunk.token_ids]


def test_each_request_gets_its_own_tokens_a_step_per_message(served, workload_prompts):
    prompts = [p[:40 + 9 * i] for i, p in enumerate(workload_prompts[:4])]
    with channel(served.address) as ch:
        stub = pb_grpc.DecodeWorkerStub(ch)
        batches = stub.Outputs(pb.OutputsRequest(session_id="s1"), timeout=60)
        assert not next(batches).chunks  # open
        messages = [decode_request(f"m{i}", p, TOGETHER) for i, p in enumerate(prompts)]
        for message in messages:
            message.output_session = "s1"
        calls = [stub.DecodeInto.future(message, timeout=60) for message in messages]
        got: dict[str, list[int]] = {}
        sizes = []
        ended = set()
        while len(ended) < len(prompts):
            batch = next(batches)
            # a sender that lags the loop may carry two steps in one message
            sizes.append(len({part.request_id for part in batch.chunks}))
            for part in batch.chunks:
                got.setdefault(part.request_id, []).extend(part.chunk.token_ids)
                if part.chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    ended.add(part.request_id)
        for call in calls:
            call.result(timeout=30)  # answered once its last chunk was sent
        batches.cancel()
    expected = {f"m{i}": per_request_stream(served, f"ref{i}", p, TOGETHER)
                for i, p in enumerate(prompts)}
    assert got == expected
    assert max(sizes) == len(prompts)  # the four running together shared a message
    assert len(sizes) < sum(len(t) for t in got.values())
    served.wait_all_free()


def test_the_router_reads_its_streams_off_one_outputs_stream(served, workload_prompts):
    stubs = WorkerStubs()
    prompts = [p[:30 + 7 * i] for i, p in enumerate(workload_prompts[4:7])]
    got: dict[int, list[int]] = {}

    def read(i: int) -> None:
        call = stubs.decode_stream(served.as_router_sees_it,
                                   decode_request(f"r{i}", prompts[i], GREEDY), 60)
        got[i] = [t for chunk in call for t in chunk.token_ids]

    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert got == {i: per_request_stream(served, f"rr{i}", p) for i, p in enumerate(prompts)}
    assert len(stubs._muxes) == 1
    served.wait_all_free()


class Driven:
    """A request read the way the HTTP front door reads it: its events driven by a
    StreamDriver, the thread of each delivery noted."""

    def __init__(self, served: Served, rid: str, prompt: list[int], params: SamplingParams):
        message = decode_request(rid, prompt, params)
        self.call = WorkerStubs().decode_stream(served.as_router_sees_it, message, 60)
        self.tokens: list[tuple[int, str]] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.scope = CallScope(60)  # a client's cancel reaches the call through it
        self.scope.track(self.call)
        events = decode_events("colocated-0", self.call, message, self.scope,
                               Finished(0, ""), None)
        StreamDriver(events, self._deliver, self._end, f"driven-{rid}").start()

    def _deliver(self, event: Tokens | Finished) -> None:
        if isinstance(event, Tokens):
            here = threading.current_thread().name
            self.tokens.extend((t, here) for t in event.token_ids)

    def _end(self, error: BaseException | None) -> None:
        self.error = error
        self.ended.set()


def test_driven_requests_stream_on_the_outputs_reader_with_no_thread_of_their_own(
        served, workload_prompts):
    prompts = [p[:35 + 6 * i] for i, p in enumerate(workload_prompts[12:15])]
    runs = [Driven(served, f"v{i}", p, STREAMED) for i, p in enumerate(prompts)]
    for run in runs:
        assert run.ended.wait(60) and run.error is None
    for i, (run, prompt) in enumerate(zip(runs, prompts)):
        assert [t for t, _ in run.tokens] == per_request_stream(served, f"vr{i}", prompt,
                                                                STREAMED)
        # Its own thread reads whatever came before it first parks (none, or on a loaded
        # machine a few steps' chunks); from then on the reader hands every chunk over until
        # the last, whose finish goes on on a thread of the request's own.
        threads = [name for _, name in run.tokens[:-1]]
        assert "outputs-colocated-0" in threads
        handed_over = threads.index("outputs-colocated-0")
        assert set(threads[:handed_over]) <= {f"driven-v{i}"}
        assert set(threads[handed_over:]) == {"outputs-colocated-0"}
    assert WAITING not in [t for run in runs for t, _ in run.tokens]
    served.wait_all_free()


def test_cancelling_a_driven_request_while_it_waits_frees_its_blocks(served, workload_prompts):
    run = Driven(served, "vc", workload_prompts[15][:30], LONG)
    wait_until(lambda: len(run.tokens) >= 3, "tokens streaming")
    run.scope.cancel()  # the client cancels
    assert run.ended.wait(30)
    assert isinstance(run.error, RouterError) and run.error.code is grpc.StatusCode.CANCELLED
    served.wait_all_free()


def test_cancelling_a_request_aborts_it_on_the_worker_and_the_stream_goes_on(served,
                                                                             workload_prompts):
    stubs = WorkerStubs()
    call = stubs.decode_stream(served.as_router_sees_it,
                               decode_request("c1", workload_prompts[7][:30], LONG), 60)
    assert next(call).token_ids
    call.cancel()
    with pytest.raises(StreamError) as failed:
        for _ in call:
            pass
    assert failed.value.code() is grpc.StatusCode.CANCELLED
    served.wait_all_free()
    again = stubs.decode_stream(served.as_router_sees_it,
                                decode_request("c2", workload_prompts[7][:30], GREEDY), 60)
    assert len([t for chunk in again for t in chunk.token_ids]) == GREEDY.max_tokens


def test_ending_the_outputs_stream_aborts_its_requests(served, workload_prompts):
    stubs = WorkerStubs()
    call = stubs.decode_stream(served.as_router_sees_it,
                               decode_request("e1", workload_prompts[8][:30], LONG), 60)
    assert next(call).token_ids
    stubs.forget("colocated-0")  # as when the router drops the worker
    with pytest.raises(StreamError) as failed:
        for _ in call:
            pass
    assert failed.value.code() is grpc.StatusCode.UNAVAILABLE
    served.wait_all_free()


def test_a_worker_aborts_the_requests_of_an_outputs_stream_that_ended(served,
                                                                     workload_prompts):
    with channel(served.address) as ch:
        stub = pb_grpc.DecodeWorkerStub(ch)
        batches = stub.Outputs(pb.OutputsRequest(session_id="s2"), timeout=60)
        next(batches)
        message = decode_request("o1", workload_prompts[11][:30], LONG)
        message.output_session = "s2"
        call = stub.DecodeInto.future(message, timeout=60)  # left running: only the stream ends
        assert next(batches).chunks
        batches.cancel()
        with pytest.raises(grpc.RpcError) as failed:
            call.result(timeout=30)
        assert failed.value.code() is grpc.StatusCode.ABORTED
    served.wait_all_free()


def test_a_last_chunk_too_large_to_send_fails_its_request_at_once(served, workload_prompts,
                                                                  monkeypatch):
    from decode_worker import service

    # The first chunk carries the prompt's logprobs; with one token it is also the last.
    monkeypatch.setattr(service, "BATCH_BYTES", 2000)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=5)
    call = WorkerStubs().decode_stream(
        served.as_router_sees_it, decode_request("big", workload_prompts[16][:60], params), 60)
    with pytest.raises(grpc.RpcError) as failed:
        for _ in call:
            pass
    # not DEADLINE_EXCEEDED: the worker's answer says why, it does not wait out the deadline
    assert failed.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "a chunk of request big is" in failed.value.details()
    served.wait_all_free()


def test_a_short_deadline_ends_the_request_on_both_sides(served, workload_prompts):
    stubs = WorkerStubs()
    # The stream opens first: the request's 0.5 s is not spent on the connection.
    assert stubs._mux(served.as_router_sees_it).attach(30)
    call = stubs.decode_stream(served.as_router_sees_it,
                               decode_request("d1", workload_prompts[9][:30], LONG), 0.5)
    with pytest.raises(grpc.RpcError) as failed:
        for _ in call:
            pass
    assert failed.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    served.wait_all_free()


def test_bad_sessions_are_refused_with_their_reasons(served):
    with channel(served.address) as ch:
        stub = pb_grpc.DecodeWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as failed:
            stub.DecodeInto(pb.DecodeRequest(request_id="x", prompt_token_ids=[1, 2],
                                             output_session="never-opened"), timeout=10)
        assert failed.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "output_session 'never-opened' is not open" in failed.value.details()
        with pytest.raises(grpc.RpcError) as failed:
            next(stub.Outputs(pb.OutputsRequest(session_id="x" * 65), timeout=10))
        assert failed.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "session_id must be 1 to 64 characters, got 65" in failed.value.details()
    served.wait_all_free()


def test_a_worker_that_goes_away_fails_its_streams_over(tiny_llama_dir, workload_prompts):
    lost = Served(str(tiny_llama_dir))
    try:
        stubs = WorkerStubs()
        message = decode_request("g1", workload_prompts[10][:30], LONG)
        call = stubs.decode_stream(lost.as_router_sees_it, message, 60)
        events = decode_events("colocated-0", call, message, CallScope(60), Finished(0, ""),
                               None)
        assert isinstance(next(events), Tokens)
        lost.server.stop(0)
        with pytest.raises(RouterError) as failed:
            for _ in events:
                pass
        assert failed.value.retryable and failed.value.suspect == "colocated-0"
        lost.wait_all_free()
        # Nothing answers there now: refused as the stream opens, or, while the lost stream's
        # end is still being read (a loaded machine), when DecodeInto fails at the first event.
        again = decode_request("g2", [1, 2], GREEDY)
        with pytest.raises(RouterError) as refused:
            call = stubs.decode_stream(lost.as_router_sees_it, again, 1)
            for _ in decode_events("colocated-0", call, again, CallScope(1), Finished(0, ""),
                                   None):
                pass
        assert refused.value.retryable and refused.value.suspect == "colocated-0"
    finally:
        lost.close()

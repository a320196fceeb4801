"""DecodeWorker gRPC servicer: translates proto <-> DecodeWorker calls, nothing more."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from common.convert import (
    finish_reason_to_proto,
    logprob_from_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from common.grpc_server import MAX_MESSAGE_BYTES
from decode_worker.departures import Paused
from decode_worker.output_sessions import (
    OutputSession,
    QueueSink,
    Sent,
    SessionSink,
    ends_request,
)
from decode_worker.worker import COMMAND_TIMEOUT_S, DecodeWorker, NoRoom, OutputSink
from engine.engine import RequestOutput
from kv_transfer import TransferDescriptor, TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.gate import QueueFull

SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name]
OUTPUTS_IDLE_S = 1.0  # how often an idle Outputs stream looks whether its router is still there
# A step's chunks are split into messages below the router's receive limit (a long prompt's
# prompt_logprobs make a large first chunk); a chunk above it fails its request alone.
BATCH_BYTES = MAX_MESSAGE_BYTES - (64 << 10)


class OutputTooLarge(RuntimeError):
    """A request's chunk does not fit in one message to the router."""


class DecodeWorkerServicer(pb_grpc.DecodeWorkerServicer):
    def __init__(self, worker: DecodeWorker):
        self.worker = worker
        self.gate = worker.gate

    def Reserve(self, request: pb.ReserveRequest, context: grpc.ServicerContext
                ) -> pb.ReserveResponse:
        self.gate.check_new(context, "Reserve")
        if not request.lease_s > 0:
            self.gate.reject(context, "Reserve", grpc.StatusCode.INVALID_ARGUMENT,
                             f"lease_s must be > 0, got {request.lease_s}")
        try:
            params = sampling_from_proto(request.sampling)
            reserved = self.worker.reserve(request.request_id, list(request.prompt_token_ids),
                                           params, request.lease_s, request.transfer_secret)
        except ValueError as exc:
            self.gate.reject(context, "Reserve", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoRoom as exc:
            self.gate.reject(context, "Reserve", grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"KV cache full: {exc}")
        except TimeoutError:
            self._loop_late(context, "Reserve", request.request_id)
        if not context.is_active():  # the router stopped waiting: nobody will abort it
            self.worker.abort_later(request.request_id)
        return pb.ReserveResponse(transfer=reserved.to_proto())

    def _loop_late(self, context: grpc.ServicerContext, method: str, request_id: str) -> None:
        """The step loop did not take the command in time. It may still run it: the abort
        queued behind it undoes what it leaves (request ids are used once)."""
        self.worker.abort_later(request_id)
        self.gate.reject(context, method, grpc.StatusCode.UNAVAILABLE,
                         f"the worker's step loop did not take {method} of {request_id} within "
                         f"{COMMAND_TIMEOUT_S:.0f}s")

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext
               ) -> Iterator[pb.TokenChunk]:
        rid = request.request_id
        sink = QueueSink()
        self._start(request, context, sink, "Decode")
        # Runs when the RPC ends for any reason (cancel, deadline, finish); after a normal finish
        # the id is unknown and the abort is a no-op. A paused request stays parked: it moves.
        paused = False
        if not context.add_callback(lambda: None if paused else self.worker.abort_later(rid)):
            self.worker.abort_later(rid)  # the call ended already (cancelled, deadline)
            return
        try:
            for i, output in enumerate(sink.drain()):
                paused = isinstance(output, Paused)
                yield _chunk(output, sink.admission_s if i == 0 else 0.0)
        except (TimeoutError, RuntimeError) as exc:
            _end_failed(context, rid, exc)

    def DecodeInto(self, request: pb.DecodeRequest, context: grpc.ServicerContext
                   ) -> pb.DecodeEnd:
        rid = request.request_id
        session = self.worker.sessions.get(request.output_session)
        if session is None:
            self.gate.reject(context, "DecodeInto", grpc.StatusCode.FAILED_PRECONDITION,
                             f"output_session {request.output_session!r} is not open on this "
                             "worker (open it with Outputs first)")
        sink = self._bind(session, rid, context)
        try:
            self._start(request, context, sink, "DecodeInto")
        except BaseException:
            sink.detach()
            raise
        if not context.add_callback(lambda: self._call_ended(sink)):
            self.worker.abort_later(rid)  # the call ended already (cancelled, deadline)
            return pb.DecodeEnd()
        try:
            sink.wait()
        except (TimeoutError, RuntimeError) as exc:
            _end_failed(context, rid, exc)
        return pb.DecodeEnd()

    def _call_ended(self, sink: SessionSink) -> None:
        """A DecodeInto call ended (answered, cancelled, past its deadline): its wait ends too,
        a last chunk not yet sent included, and a request still running is aborted (a paused
        one stays parked: it moves)."""
        sink.fail(RuntimeError("its DecodeInto call ended"))
        if not sink.paused:
            self.worker.abort_later(sink.request_id)

    def _bind(self, session: OutputSession, request_id: str, context: grpc.ServicerContext
              ) -> OutputSink:
        try:
            return session.bind(request_id)
        except ValueError as exc:
            self.gate.reject(context, "DecodeInto", grpc.StatusCode.FAILED_PRECONDITION, str(exc))

    def Outputs(self, request: pb.OutputsRequest, context: grpc.ServicerContext
                ) -> Iterator[pb.OutputBatch]:
        try:
            session, orphans = self.worker.sessions.open(request.session_id)
        except ValueError as exc:
            self.gate.reject(context, "Outputs", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        self._abort_all(orphans)

        def close() -> None:  # its router is gone: so are the requests it was reading
            self._abort_all(self.worker.sessions.close(session))

        if not context.add_callback(close):
            close()  # the call ended before it started here
            return
        try:
            yield pb.OutputBatch()  # the session is open: DecodeInto may name it
            while context.is_active():
                taken = session.take(OUTPUTS_IDLE_S)
                if taken is None:
                    return
                yield from _batches(taken)
        finally:
            close()

    def _abort_all(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            self.worker.abort_later(request_id)

    def _start(self, request: pb.DecodeRequest, context: grpc.ServicerContext,
               sink: OutputSink, method: str) -> None:
        """Start the request with its outputs going to `sink`: resumed, admitted after its KV
        arrived, or a whole generation."""
        rid = request.request_id
        try:
            if request.resume:
                return self.worker.start_resumed(rid, sink)
            if request.HasField("first_token_id"):
                first_lp = (logprob_from_proto(request.first_logprob)
                            if request.HasField("first_logprob") else None)
                return self.worker.start_admitted(rid, request.first_token_id, first_lp,
                                                  request.forks, sink)
            self.gate.check_new(context, method)
            return self.worker.start_generation(rid, list(request.prompt_token_ids),
                                                sampling_from_proto(request.sampling), sink,
                                                request.forks, request.fork_of)
        except KeyError as exc:
            self.gate.reject(context, method, grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            self.gate.reject(context, method, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            self.gate.reject(context, method, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:  # the engine failed it (e.g. a fork's block copy)
            self.gate.reject(context, method, grpc.StatusCode.ABORTED, str(exc))
        except TimeoutError:
            self._loop_late(context, method, rid)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        try:
            return pb.AbortResponse(found=self.worker.abort(request.request_id))
        except TimeoutError:
            self._loop_late(context, "Abort", request.request_id)

    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext
              ) -> pb.PauseResponse:
        try:
            paused = self.worker.pause(list(request.request_ids), request.lease_s)
        except ValueError as exc:
            self.gate.reject(context, "Pause", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except TimeoutError:  # nothing was paused: each stays where it runs
            self.gate.reject(context, "Pause", grpc.StatusCode.UNAVAILABLE,
                             f"the worker's step loop did not take Pause within "
                             f"{COMMAND_TIMEOUT_S:.0f}s")
        return pb.PauseResponse(paused=paused)

    def MigrateOut(self, request: pb.MigrateOutRequest, context: grpc.ServicerContext
                   ) -> pb.MigrateOutResponse:
        try:
            stats = self.worker.migrate_out(request.request_id, request.kv_transport,
                                            TransferDescriptor.from_proto(request.transfer),
                                            request.transfer_secret)
        except KeyError as exc:
            self.gate.reject(context, "MigrateOut", grpc.StatusCode.NOT_FOUND, str(exc.args[0]))
        except ValueError as exc:
            self.gate.reject(context, "MigrateOut", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except (TransferError, TimeoutError) as exc:
            self.gate.reject(context, "MigrateOut", grpc.StatusCode.ABORTED,
                             f"moving the KV of {request.request_id} failed: {exc}")
        return pb.MigrateOutResponse(kv_transfer_s=stats.seconds,
                                     kv_transfer_bytes=stats.num_bytes,
                                     kv_transport=stats.transport)


def _end_failed(context: grpc.ServicerContext, request_id: str, exc: BaseException) -> None:
    if isinstance(exc, TimeoutError):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
    if isinstance(exc, OutputTooLarge):
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
    context.abort(grpc.StatusCode.ABORTED, f"request {request_id} ended: {exc}")


def _batches(taken: list[Sent]) -> Iterator[pb.OutputBatch]:
    """A step's outputs as messages below the router's receive limit; a request whose chunk
    cannot go fails alone (its DecodeInto call says why), not the session. A request's last
    chunk ends its DecodeInto call once the message carrying it was handed to the stream."""
    parts: list[pb.RequestChunk] = []
    ending: list[SessionSink] = []
    size = 0
    for sent in taken:
        if sent.sink.failed:  # an earlier chunk of it could not go: the rest must not either
            sent.sink.session.forget_last(sent.sink)
            continue
        sendable = _sendable_chunk(sent)
        if sendable is None:
            continue
        part, part_size = sendable
        if parts and size + part_size > BATCH_BYTES:
            yield pb.OutputBatch(chunks=parts)
            _delivered(ending)
            parts, ending, size = [], [], 0
        parts.append(part)
        size += part_size
        if ends_request(sent.item):
            ending.append(sent.sink)
    if parts:
        yield pb.OutputBatch(chunks=parts)
        _delivered(ending)


def _sendable_chunk(sent: Sent) -> tuple[pb.RequestChunk, int] | None:
    """`sent` encoded, with its size, or None with its request failed: it cannot be encoded,
    or it is larger than one message may be."""
    try:
        part = _request_chunk(sent)
    except Exception as exc:  # noqa: BLE001 - its own request's failure, reported on its call
        sent.sink.fail(RuntimeError(f"its output could not be encoded: {exc!r}"))
        return None
    size = part.ByteSize()  # computed by serializing: once per chunk
    if size > BATCH_BYTES:
        sent.sink.fail(OutputTooLarge(
            f"a chunk of request {sent.request_id} is {size} bytes, over the "
            f"{BATCH_BYTES}-byte message limit (prompt_logprobs of a long prompt?)"))
        return None
    return part, size


def _delivered(sinks: list[SessionSink]) -> None:
    for sink in sinks:
        sink.delivered()


def _request_chunk(sent: Sent) -> pb.RequestChunk:
    """One output of a session, the request's first marked with its admission time."""
    first, sent.sink.first_sent = not sent.sink.first_sent, True
    return pb.RequestChunk(request_id=sent.request_id,
                           chunk=_chunk(sent.item, sent.sink.admission_s if first else 0.0))


def _chunk(output: RequestOutput | Paused, admission_s: float = 0.0) -> pb.TokenChunk:
    if isinstance(output, Paused):
        return pb.TokenChunk(paused=True)
    chunk = pb.TokenChunk(token_ids=output.new_token_ids, admission_s=admission_s)
    if output.num_output_tokens == len(output.new_token_ids):  # the first chunk
        chunk.cached_tokens = output.num_cached_tokens
        chunk.forked = output.forked
        chunk.queue_s = output.queue_s or 0.0
        chunk.prefill_s = (output.ttft_s or 0.0) - chunk.queue_s
        # computed here only for a whole generation (an admitted one's came from its prefill)
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(output.prompt_token_ids,
                                                              output.prompt_logprobs))
    if output.logprobs is not None:  # the last len(new_token_ids) are the chunk's
        offset = len(output.logprobs) - len(output.new_token_ids)
        chunk.logprobs.extend(logprob_to_proto(t, output.logprobs[offset + i])
                              for i, t in enumerate(output.new_token_ids))
    if output.finished:
        chunk.finish_reason = finish_reason_to_proto(output.finish_reason)
        chunk.stop_reason = stop_reason_to_proto(output.stop_reason)
    return chunk

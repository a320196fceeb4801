"""DecodeWorker gRPC servicer: translates proto <-> DecodeWorker calls, nothing more."""

from __future__ import annotations

from collections.abc import Iterator

import grpc

from common.convert import (
    finish_reason_to_proto,
    logprob_from_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from decode_worker.departures import Paused
from decode_worker.worker import DecodeWorker, NoRoom
from engine.engine import RequestOutput
from kv_transfer import TransferDescriptor, TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from serving.gate import QueueFull

SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name["DecodeWorker"].full_name]


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
        return pb.ReserveResponse(transfer=reserved.to_proto())

    def Decode(self, request: pb.DecodeRequest, context: grpc.ServicerContext
               ) -> Iterator[pb.TokenChunk]:
        rid = request.request_id
        admission_s, outputs = self._outputs(request, context)
        # Runs when the RPC ends for any reason (cancel, deadline, finish); after a normal finish
        # the id is unknown and the abort is a no-op. A paused request stays parked: it moves.
        paused = False
        context.add_callback(lambda: None if paused else self.worker.abort_later(rid))
        try:
            for i, output in enumerate(outputs):
                if isinstance(output, Paused):
                    paused = True
                    yield pb.TokenChunk(paused=True)
                    return
                chunk = _chunk(output)
                if i == 0:
                    chunk.admission_s = admission_s
                yield chunk
        except TimeoutError as exc:
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
        except RuntimeError as exc:
            context.abort(grpc.StatusCode.ABORTED, f"request {rid} ended: {exc}")

    def _outputs(self, request: pb.DecodeRequest, context: grpc.ServicerContext
                 ) -> tuple[float, Iterator[RequestOutput | Paused]]:
        """The request's outputs: resumed, admitted after its KV arrived, or a whole generation
        (and, admitted, the seconds until it joined the batch)."""
        rid = request.request_id
        try:
            if request.resume:
                return 0.0, self.worker.resume(rid)
            if request.HasField("first_token_id"):
                first_lp = (logprob_from_proto(request.first_logprob)
                            if request.HasField("first_logprob") else None)
                return self.worker.admit(rid, request.first_token_id, first_lp, request.forks)
            self.gate.check_new(context, "Decode")
            return 0.0, self.worker.generate(rid, list(request.prompt_token_ids),
                                             sampling_from_proto(request.sampling),
                                             request.forks, request.fork_of)
        except KeyError as exc:
            self.gate.reject(context, "Decode", grpc.StatusCode.NOT_FOUND, str(exc))
        except ValueError as exc:
            self.gate.reject(context, "Decode", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            self.gate.reject(context, "Decode", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except RuntimeError as exc:  # the engine failed it (e.g. a fork's block copy)
            self.gate.reject(context, "Decode", grpc.StatusCode.ABORTED, str(exc))

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.worker.abort(request.request_id))

    def Pause(self, request: pb.PauseRequest, context: grpc.ServicerContext
              ) -> pb.PauseResponse:
        try:
            paused = self.worker.pause(list(request.request_ids), request.lease_s)
        except ValueError as exc:
            self.gate.reject(context, "Pause", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
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


def _chunk(output: RequestOutput) -> pb.TokenChunk:
    chunk = pb.TokenChunk(token_ids=output.new_token_ids)
    if len(output.token_ids) == len(output.new_token_ids):  # the first chunk
        chunk.cached_tokens = output.num_cached_tokens
        chunk.forked = output.forked
        chunk.queue_s = output.queue_s or 0.0
        chunk.prefill_s = (output.ttft_s or 0.0) - chunk.queue_s
        # computed here only for a whole generation (an admitted one's came from its prefill)
        chunk.prompt_logprobs.extend(prompt_logprobs_to_proto(output.prompt_token_ids,
                                                              output.prompt_logprobs))
    if output.logprobs is not None:
        offset = len(output.token_ids) - len(output.new_token_ids)
        chunk.logprobs.extend(logprob_to_proto(t, output.logprobs[offset + i])
                              for i, t in enumerate(output.new_token_ids))
    if output.finished:
        chunk.finish_reason = finish_reason_to_proto(output.finish_reason)
        chunk.stop_reason = stop_reason_to_proto(output.stop_reason)
    return chunk

"""PrefillWorker gRPC servicer: translates proto <-> PrefillWorker calls, nothing more."""

from __future__ import annotations

import grpc

from common.convert import (
    finish_reason_to_proto,
    logprob_to_proto,
    prompt_logprobs_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from common.grpc_server import call_budget_s
from kv_transfer import TransferDescriptor, TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from prefill_worker.handoff import PrefillResult
from prefill_worker.worker import PrefillWorker
from serving.gate import QueueFull

SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name]
DEFAULT_TIMEOUT_S = 600.0  # a Prefill call without a deadline


class PrefillWorkerServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.gate = worker.gate

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext
                ) -> pb.PrefillResponse:
        self.gate.check_new(context, "Prefill")
        # When the call ends (cancelled, past its deadline, or answered: then a no-op), the
        # request stops here, even one queued after an Abort that found nothing yet.
        if not context.add_callback(lambda: self.worker.abort_later(request.request_id)):
            return pb.PrefillResponse()  # the call ended before it started
        timeout_s = call_budget_s(context.time_remaining(), DEFAULT_TIMEOUT_S)
        descriptor = TransferDescriptor.from_proto(request.transfer)
        receiver = descriptor.receiver_id
        try:
            transfer = self.worker.transfer(request.request_id, request.kv_transport, descriptor,
                                            request.transfer_secret)
            result = self.worker.prefill(list(request.prompt_token_ids),
                                         sampling_from_proto(request.sampling), transfer,
                                         timeout_s)
        except ValueError as exc:
            self.gate.reject(context, "Prefill", grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except QueueFull as exc:
            self.gate.reject(context, "Prefill", grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except TimeoutError:
            self.gate.reject(context, "Prefill", grpc.StatusCode.DEADLINE_EXCEEDED,
                             f"prefill of {request.request_id} did not finish in "
                             f"{timeout_s:.1f}s")
        except TransferError as exc:
            if exc.permanent:  # the same pair would fail again: the router places another
                self.gate.reject(context, "Prefill", grpc.StatusCode.FAILED_PRECONDITION,
                                 f"KV transfer {self.worker.worker_id} -> {receiver} "
                                 f"cannot work: {exc}")
            # ABORTED tells the router the KV did not reach the decode worker (which may be the
            # one at fault): it retries with a fresh reservation.
            self.gate.reject(context, "Prefill", grpc.StatusCode.ABORTED,
                             f"KV transfer to {receiver} failed: {exc}")
        except RuntimeError as exc:
            self.gate.reject(context, "Prefill", grpc.StatusCode.UNAVAILABLE, str(exc))
        return _response(result)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        try:
            return pb.AbortResponse(found=self.worker.abort(request.request_id))
        except TimeoutError:
            self.worker.abort_later(request.request_id)
            self.gate.reject(context, "Abort", grpc.StatusCode.UNAVAILABLE,
                             f"the worker's step loop did not take Abort of "
                             f"{request.request_id} in time")


def _response(result: PrefillResult) -> pb.PrefillResponse:
    response = pb.PrefillResponse(first_token_id=result.first_token,
                                  cached_tokens=result.cached_tokens, prefill_s=result.prefill_s,
                                  queue_s=result.queue_s)
    if result.logprobs is not None:
        response.first_logprob.CopyFrom(logprob_to_proto(result.first_token, result.logprobs))
    response.prompt_logprobs.extend(prompt_logprobs_to_proto(result.prompt_token_ids,
                                                             result.prompt_logprobs))
    if result.transfer is not None:
        response.kv_transfer_s = result.transfer.seconds
        response.kv_transfer_bytes = result.transfer.num_bytes
        response.kv_transport = result.transfer.transport
    if result.finish_reason is not None:
        response.finish_reason = finish_reason_to_proto(result.finish_reason)
        response.stop_reason = stop_reason_to_proto(result.stop_reason)
    return response

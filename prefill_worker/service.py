"""PrefillWorker gRPC servicer (proto <-> PrefillWorker), and the client side of the decode
worker's ReceiveKV used to start each transfer."""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc

from common.convert import (
    finish_reason_to_proto,
    logprob_to_proto,
    sampling_from_proto,
    stop_reason_to_proto,
)
from common.grpc_server import call_budget_s, internal_channel
from kv_transfer import KVPlace, TransferError
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from prefill_worker.handoff import DecodeTarget, PrefillResult
from prefill_worker.worker import PrefillWorker
from serving.gate import QueueFull

SERVICE_NAMES = [pb.DESCRIPTOR.services_by_name["PrefillWorker"].full_name]
DEFAULT_TIMEOUT_S = 600.0  # a Prefill call without a deadline


class DecodeStubs:
    """One channel per decode worker address, shared by every transfer to it: the KV control
    RPCs (`prefill_worker.worker.DecodeControl`) this prefill worker sends as `sender_id`."""

    def __init__(self, rpc_timeout_s: float, sender_id: str):
        self.rpc_timeout_s = rpc_timeout_s
        self.sender_id = sender_id
        self._stubs: dict[str, pb_grpc.DecodeWorkerStub] = {}
        self._lock = threading.Lock()

    def stub(self, address: str) -> pb_grpc.DecodeWorkerStub:
        with self._lock:
            if address not in self._stubs:
                self._stubs[address] = pb_grpc.DecodeWorkerStub(internal_channel(address))
            return self._stubs[address]

    def start_receive(self, target: DecodeTarget, request_id: str, generation: int, tag: int,
                      num_blocks: int, dtype: str, first_block: int = 0,
                      more: bool = False, mac: bytes = b"") -> Callable[[float], object]:
        message = pb.ReceiveKVRequest(request_id=request_id, sender_id=self.sender_id,
                                      generation=generation, tag=tag, num_blocks=num_blocks,
                                      dtype=dtype, first_block=first_block, more=more,
                                      transfer_secret=target.transfer_secret, piece_mac=mac)
        future = self.stub(target.address).ReceiveKV.future(message, timeout=self.rpc_timeout_s)

        def wait_ack(timeout_s: float) -> object:
            try:
                return future.result(timeout=timeout_s)
            except grpc.RpcError as exc:
                raise TransferError(f"decode worker {target.worker_id} did not acknowledge "
                                    f"the KV: {exc.code().name}: {exc.details()}") from exc

        return wait_ack


class PrefillWorkerServicer(pb_grpc.PrefillWorkerServicer):
    def __init__(self, worker: PrefillWorker):
        self.worker = worker
        self.gate = worker.gate

    def Prefill(self, request: pb.PrefillRequest, context: grpc.ServicerContext
                ) -> pb.PrefillResponse:
        self.gate.check_new(context, "Prefill")
        timeout_s = call_budget_s(context.time_remaining(), DEFAULT_TIMEOUT_S)
        target = _target(request)
        try:
            result = self.worker.prefill(request.request_id, list(request.prompt_token_ids),
                                         sampling_from_proto(request.sampling), target,
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
                                 f"KV transfer {self.worker.worker_id} -> {target.worker_id} "
                                 f"cannot work: {exc}")
            # ABORTED tells the router the KV did not reach the decode worker (which may be the
            # one at fault): it retries with a fresh reservation.
            self.gate.reject(context, "Prefill", grpc.StatusCode.ABORTED,
                             f"KV transfer to {target.worker_id} failed: {exc}")
        except RuntimeError as exc:
            self.gate.reject(context, "Prefill", grpc.StatusCode.UNAVAILABLE, str(exc))
        return _response(result)

    def Abort(self, request: pb.AbortRequest, context: grpc.ServicerContext
              ) -> pb.AbortResponse:
        return pb.AbortResponse(found=self.worker.abort(request.request_id))


def _target(request: pb.PrefillRequest) -> DecodeTarget:
    place = None
    if request.decode_host_id:  # a router that knows where the decode worker's cache lives
        place = KVPlace(request.decode_worker_id, request.decode_host_id,
                        request.decode_kv_device or "cpu", request.decode_kv_transport or "auto")
    return DecodeTarget(request.decode_worker_id, request.decode_address,
                        request.transfer_address, list(request.decode_block_ids), place,
                        request.decode_kv_export_address, request.decode_cached_blocks,
                        request.transfer_secret)


def _response(result: PrefillResult) -> pb.PrefillResponse:
    response = pb.PrefillResponse(first_token_id=result.first_token,
                                  cached_tokens=result.cached_tokens, prefill_s=result.prefill_s,
                                  queue_s=result.queue_s)
    if result.logprobs is not None:
        response.first_logprob.CopyFrom(logprob_to_proto(result.first_token, result.logprobs))
    if result.transfer is not None:
        response.kv_transfer_s = result.transfer.seconds
        response.kv_transfer_bytes = result.transfer.num_bytes
        response.kv_transport = result.transfer.transport
    if result.finish_reason is not None:
        response.finish_reason = finish_reason_to_proto(result.finish_reason)
        response.stop_reason = stop_reason_to_proto(result.stop_reason)
    return response

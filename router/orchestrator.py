"""A request's path through the cluster: reserve on a decode worker, prefill (which ships the KV),
then stream the decode worker's tokens — or, in colocated mode, one worker does it all.
Yields domain events; the servicer turns them into proto."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import grpc

from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from router.calls import CallScope, RouterError, worker_error
from router.frontend import Job
from router.placement import Charge, PlacementPolicy
from router.registry import Role, Worker
from serving.convert import sampling_to_proto
from serving.grpc_server import channel

log = logging.getLogger(__name__)
ABORT_TIMEOUT_S = 2.0
LEASE_MARGIN_S = 5.0


@dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = field(default_factory=list)


@dataclass
class Finished:
    finish_reason: int
    stop_reason: str
    cached_tokens: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    prefill_started: float = 0.0


class WorkerStubs:
    """One channel per worker address."""

    def __init__(self) -> None:
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            if address not in self._channels:
                self._channels[address] = channel(address)
            return self._channels[address]

    def decode(self, worker: Worker) -> pb_grpc.DecodeWorkerStub:
        return pb_grpc.DecodeWorkerStub(self._channel(worker.address))

    def prefill(self, worker: Worker) -> pb_grpc.PrefillWorkerStub:
        return pb_grpc.PrefillWorkerStub(self._channel(worker.address))


class Orchestrator:
    def __init__(self, placement: PlacementPolicy, stubs: WorkerStubs, lease_s: float = 30.0):
        self.placement = placement
        self.stubs = stubs
        self.lease_s = lease_s

    def run(self, job: Job, scope: CallScope) -> Iterator[Tokens | Finished]:
        registry = self.placement.registry
        if registry.placeable(lambda r: r is Role.PREFILL) and \
                registry.placeable(lambda r: r is Role.DECODE):
            yield from self._disaggregated(job, scope)
        elif registry.placeable(lambda r: r is Role.COLOCATED):
            yield from self._colocated(job, scope)
        else:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              "no healthy workers: need a prefill and a decode worker, or a "
                              "colocated one")

    def _disaggregated(self, job: Job, scope: CallScope) -> Iterator[Tokens | Finished]:
        decode, decode_charge = self._place(
            self.placement.place_decode(len(job.token_ids) + job.params.max_tokens,
                                        roles=(Role.DECODE,)), "decode", job)
        placed: list[Worker] = []
        done = False
        try:
            first, end = self._reserve_and_prefill(job, scope, decode, decode_charge, placed)
            yield Tokens([first.first_token_id],
                         [first.first_logprob] if first.HasField("first_logprob") else [])
            if first.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                self._abort(decode, job, "decode")  # free the reservation nobody will use
                done = True
                yield end
                return
            message = pb.DecodeRequest(request_id=job.worker_request_id,
                                       first_token_id=first.first_token_id)
            if first.HasField("first_logprob"):
                message.first_logprob.CopyFrom(first.first_logprob)
            for item in self._stream(decode, message, scope, end):
                done = isinstance(item, Finished)
                yield item
        finally:
            if not done:  # cancel, deadline or error: nothing may stay allocated
                self._abort(decode, job, "decode")
                for prefill in placed:
                    self._abort(prefill, job, "prefill")

    def _reserve_and_prefill(self, job: Job, scope: CallScope, decode: Worker,
                             decode_charge: Charge, placed: list[Worker]
                             ) -> tuple[pb.PrefillResponse, Finished]:
        """Reserve blocks on the decode worker, then prefill (which ships the KV there).
        Placement charges end here: by now the workers' own load reports include the work."""
        charges = [decode_charge]
        try:
            reserve = scope.unary(self.stubs.decode(decode).Reserve, pb.ReserveRequest(
                request_id=job.worker_request_id, prompt_token_ids=job.token_ids,
                sampling=sampling_to_proto(job.params),
                # The router aborts the reservation on every failure path it sees; the lease is
                # the backstop for what it cannot see (its own death), so it lasts as long as the
                # request may: KV arriving after the deadline is useless anyway.
                lease_s=max(self.lease_s, scope.timeout() + LEASE_MARGIN_S)), "reserve")
            prefill, prefill_charge = self._place(
                self.placement.place_prefill(len(job.token_ids), roles=(Role.PREFILL,)),
                "prefill", job)
            charges.append(prefill_charge)
            placed.append(prefill)
            started = time.monotonic()
            first = scope.unary(self.stubs.prefill(prefill).Prefill, pb.PrefillRequest(
                request_id=job.worker_request_id, prompt_token_ids=job.token_ids,
                sampling=sampling_to_proto(job.params), decode_worker_id=decode.worker_id,
                decode_address=decode.address, transfer_address=reserve.transfer_address,
                decode_block_ids=reserve.block_ids), "prefill")
        finally:
            for charge in charges:
                self.placement.release(charge)
        return first, Finished(first.finish_reason, first.stop_reason, first.cached_tokens,
                               first.kv_transfer_s, first.kv_transfer_bytes, started)

    def _colocated(self, job: Job, scope: CallScope) -> Iterator[Tokens | Finished]:
        worker, charge = self._place(
            self.placement.place_decode(len(job.token_ids) + job.params.max_tokens,
                                        roles=(Role.COLOCATED,)), "colocated", job)
        done = False
        try:
            message = pb.DecodeRequest(request_id=job.worker_request_id,
                                       prompt_token_ids=job.token_ids,
                                       sampling=sampling_to_proto(job.params))
            for item in self._stream(worker, message, scope, Finished(0, "", 0, 0.0, 0,
                                                                       time.monotonic()),
                                     on_first=lambda: self.placement.release(charge)):
                done = isinstance(item, Finished)
                yield item
        finally:
            self.placement.release(charge)
            if not done:
                self._abort(worker, job, "colocated")

    def _stream(self, worker: Worker, message: pb.DecodeRequest, scope: CallScope,
                end: Finished, on_first: Callable[[], None] | None = None
                ) -> Iterator[Tokens | Finished]:
        call = scope.track(self.stubs.decode(worker).Decode(message, timeout=scope.timeout()))
        try:
            for chunk in call:
                if on_first is not None:
                    on_first()
                    on_first = None
                if chunk.token_ids:
                    yield Tokens(list(chunk.token_ids), list(chunk.logprobs))
                if chunk.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                    end.finish_reason, end.stop_reason = chunk.finish_reason, chunk.stop_reason
                    yield end
                    return
        except grpc.RpcError as exc:
            raise worker_error(exc, f"decode on {worker.worker_id}", scope) from exc
        raise RouterError(grpc.StatusCode.UNAVAILABLE,
                          f"decode worker {worker.worker_id} ended the stream without finishing")

    def _place(self, placed: tuple[Worker, Charge] | None, what: str, job: Job
               ) -> tuple[Worker, Charge]:
        if placed is None:
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"no {what} worker can take a request of {len(job.token_ids)} "
                              f"prompt + {job.params.max_tokens} max tokens right now")
        return placed

    def _abort(self, worker: Worker, job: Job, what: str) -> None:
        stub = self.stubs.decode(worker) if what != "prefill" else self.stubs.prefill(worker)
        try:
            stub.Abort(pb.AbortRequest(request_id=job.worker_request_id),
                       timeout=ABORT_TIMEOUT_S)
        except grpc.RpcError as exc:
            log.warning("abort of %s on %s failed: %s", job.worker_request_id, worker.worker_id,
                        exc.code().name)

"""A request's path through the cluster: reserve on a decode worker, prefill (which ships the KV),
then stream the decode worker's tokens — or, in colocated mode, one worker does it all.

Worker failures do not fail the request: a failed prefill (the worker died, or the KV transfer
broke) is retried on another worker with a fresh reservation, and a decode worker dying
mid-stream makes the request migrate — it is prefilled again with the prompt plus every token
already streamed, so the client sees neither a duplicate nor a gap. Every attempt aborts what it
holds on any path but success. Yields domain events; the servicer turns them into proto."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator

import grpc

from pdserve_proto import pdserve_pb2 as pb
from router.calls import CallScope, RouterError, worker_error
from router.frontend import Job
from router.metrics import RouterMetrics
from router.placement import Charge, PlacementPolicy, Suspects
from router.registry import Role, Worker
from router.stubs import WorkerStubs
from serving.convert import sampling_to_proto

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 5.0
MAX_ATTEMPTS = 4  # per request: the first try plus retries and migrations
PLACEMENT_POLL_S = 0.05  # how often a request waiting for KV room looks again


@dataclasses.dataclass
class Tokens:
    token_ids: list[int]
    logprobs: list[pb.TokenLogprob] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Finished:
    finish_reason: int
    stop_reason: str
    cached_tokens: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    kv_transport: str = ""
    prefill_started: float = 0.0
    attempts: int = 1


class Orchestrator:
    def __init__(self, placement: PlacementPolicy, stubs: WorkerStubs, metrics: RouterMetrics,
                 lease_s: float = 30.0, max_attempts: int = MAX_ATTEMPTS):
        self.placement = placement
        self.registry = placement.registry
        self.stubs = stubs
        self.metrics = metrics
        self.lease_s = lease_s
        self.max_attempts = max_attempts

    def run(self, job: Job, scope: CallScope) -> Iterator[Tokens | Finished]:
        emitted: list[int] = []
        suspects = Suspects(self.registry.heartbeat_timeout_s)
        end = Finished(pb.FINISH_REASON_UNSPECIFIED, "")
        for attempt in range(1, self.max_attempts + 1):
            end.attempts = attempt
            if len(emitted) >= job.params.max_tokens:  # lost only the finish message
                end.finish_reason = pb.FINISH_REASON_LENGTH
                yield end
                return
            part = _continuation(job, emitted, attempt)
            try:
                for event in self._attempt(part, scope, suspects, end):
                    if isinstance(event, Tokens):
                        emitted.extend(event.token_ids)
                    yield event
                return
            except RouterError as exc:
                if not exc.retryable or attempt == self.max_attempts:
                    raise
                if exc.suspect:
                    suspects.add(exc.suspect)
                (self.metrics.migrations if emitted else self.metrics.retries).inc()
                log.warning("request %s: %s; %s (attempt %d)", job.request_id, exc.message,
                            "migrating" if emitted else "retrying", attempt + 1)

    def _attempt(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished
                 ) -> Iterator[Tokens | Finished]:
        if self._exists(Role.PREFILL) and self._exists(Role.DECODE):
            yield from self._disaggregated(part, scope, suspects, end)
        elif self._exists(Role.COLOCATED):
            yield from self._colocated(part, scope, suspects, end)
        else:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              "no healthy workers: need a prefill and a decode worker, or a "
                              "colocated one")

    def _exists(self, role: Role) -> bool:
        return bool(self.registry.placeable(lambda r: r is role))

    # ---- disaggregated ---------------------------------------------------------------------
    def _disaggregated(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished
                       ) -> Iterator[Tokens | Finished]:
        holders: list[tuple[Worker, str]] = []
        done = False
        try:
            decode, reserve, charge = self._reserve(part, scope, suspects, holders)
            try:
                first = self._prefill(part, scope, suspects, decode, reserve, holders, end)
            finally:
                self.placement.release(charge)
            yield Tokens([first.first_token_id],
                         [first.first_logprob] if first.HasField("first_logprob") else [])
            if first.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                done = True
                self._abort_all(holders, part)  # free the reservation nobody will use
                end.finish_reason, end.stop_reason = first.finish_reason, first.stop_reason
                yield end
                return
            message = pb.DecodeRequest(request_id=part.worker_request_id,
                                       first_token_id=first.first_token_id)
            if first.HasField("first_logprob"):
                message.first_logprob.CopyFrom(first.first_logprob)
            for item in self._stream(decode, message, scope, end):
                done = isinstance(item, Finished)
                yield item
        finally:
            if not done:  # cancel, deadline or failure: nothing may stay allocated
                self._abort_all(holders, part)

    def _reserve(self, part: Job, scope: CallScope, suspects: Suspects,
                 holders: list[tuple[Worker, str]]) -> tuple[Worker, pb.ReserveResponse, Charge]:
        """Blocks on a decode worker, waiting (within the deadline) until one has room."""
        total = len(part.token_ids) + part.params.max_tokens
        while True:
            unpairable = self.placement.unpairable()
            if unpairable is not None:  # waiting cannot help: the placement itself is wrong
                raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, unpairable)
            placed = self.placement.place_decode(total, suspects.current(), (Role.DECODE,),
                                                 paired=True)
            if placed is None:
                self._wait_for_room(Role.DECODE, total, scope, suspects)
                continue
            decode, charge = placed
            try:
                reply = scope.unary(self.stubs.decode(decode).Reserve, pb.ReserveRequest(
                    request_id=part.worker_request_id, prompt_token_ids=part.token_ids,
                    sampling=sampling_to_proto(part.params),
                    # The router aborts the reservation on every failure path it sees; the lease
                    # is the backstop for what it cannot see (its own death), so it lasts as long
                    # as the request may: KV arriving after the deadline is useless anyway.
                    lease_s=max(self.lease_s, scope.timeout() + LEASE_MARGIN_S)), "reserve")
            except RouterError as exc:
                self.placement.release(charge)
                if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # our view was stale
                    scope.pause(PLACEMENT_POLL_S)
                    continue
                exc.suspect = decode.worker_id
                raise
            holders.append((decode, "decode"))
            return decode, reply, charge

    def _prefill(self, part: Job, scope: CallScope, suspects: Suspects, decode: Worker,
                 reserve: pb.ReserveResponse, holders: list[tuple[Worker, str]], end: Finished
                 ) -> pb.PrefillResponse:
        while True:
            placed = self.placement.place_prefill(len(part.token_ids), suspects.current(),
                                                  (Role.PREFILL,), decode)
            if placed is None:
                self._wait_for_room(Role.PREFILL, 0, scope, suspects)
                continue
            prefill, charge = placed
            started = time.monotonic()
            holders.append((prefill, "prefill"))
            try:
                first = scope.unary(self.stubs.prefill(prefill).Prefill, pb.PrefillRequest(
                    request_id=part.worker_request_id, prompt_token_ids=part.token_ids,
                    sampling=sampling_to_proto(part.params), decode_worker_id=decode.worker_id,
                    decode_address=decode.address, transfer_address=reserve.transfer_address,
                    decode_block_ids=reserve.block_ids, decode_host_id=decode.host_id,
                    decode_kv_device=decode.kv_device, decode_kv_transport=decode.kv_transport,
                    decode_kv_export_address=decode.kv_export_address), "prefill")
            except RouterError as exc:
                if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # its queue is full
                    holders.pop()
                    scope.pause(PLACEMENT_POLL_S)
                    continue
                if exc.worker_code is grpc.StatusCode.FAILED_PRECONDITION:
                    # This pair can never move KV: never again together; try another pair.
                    self.placement.mark_broken(prefill, decode, exc.message)
                    exc.retryable = True
                    raise
                # ABORTED: the prefill worker is fine but its KV did not reach the decode one.
                transfer_failed = exc.worker_code is grpc.StatusCode.ABORTED
                exc.suspect = decode.worker_id if transfer_failed else prefill.worker_id
                raise
            finally:
                self.placement.release(charge)
            end.prefill_started = end.prefill_started or started
            end.cached_tokens = end.cached_tokens or first.cached_tokens
            end.kv_transfer_s += first.kv_transfer_s
            end.kv_transfer_bytes += first.kv_transfer_bytes
            end.kv_transport = first.kv_transport or end.kv_transport
            transport = first.kv_transport or "none"
            self.metrics.kv_transfer_bytes.labels(transport).inc(first.kv_transfer_bytes)
            self.metrics.kv_transfer_seconds.labels(transport).inc(first.kv_transfer_s)
            return first

    # ---- colocated -------------------------------------------------------------------------
    def _colocated(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished
                   ) -> Iterator[Tokens | Finished]:
        total = len(part.token_ids) + part.params.max_tokens
        placed = self.placement.place_decode(total, suspects.current(), (Role.COLOCATED,))
        while placed is None:
            self._wait_for_room(Role.COLOCATED, total, scope, suspects)
            placed = self.placement.place_decode(total, suspects.current(), (Role.COLOCATED,))
        worker, charge = placed
        end.prefill_started = end.prefill_started or time.monotonic()
        message = pb.DecodeRequest(request_id=part.worker_request_id,
                                   prompt_token_ids=part.token_ids,
                                   sampling=sampling_to_proto(part.params))
        done = False
        try:
            for item in self._stream(worker, message, scope, end,
                                     on_first=lambda: self.placement.release(charge)):
                done = isinstance(item, Finished)
                yield item
        finally:
            self.placement.release(charge)
            if not done:
                self._abort_all([(worker, "colocated")], part)

    # ---- shared ----------------------------------------------------------------------------
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
            error = worker_error(exc, f"decode on {worker.worker_id}", scope)
            error.suspect = worker.worker_id
            raise error from exc
        raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode worker {worker.worker_id} ended "
                          "the stream without finishing", retryable=True,
                          suspect=worker.worker_id)

    def _wait_for_room(self, role: Role, total_tokens: int, scope: CallScope,
                       suspects: Suspects) -> None:
        """Nothing placeable now: fail if nothing ever could be, else wait a little."""
        workers = self.registry.placeable(lambda r: r is role)
        if not workers:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              f"no healthy {role.value} worker is left")
        if total_tokens and not any(w.load.total_blocks * w.block_size >= total_tokens
                                    for w in workers):
            raise RouterError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                              f"a request of {total_tokens} tokens (prompt + max_tokens) does "
                              f"not fit in the KV cache of any {role.value} worker")
        scope.pause(PLACEMENT_POLL_S)

    def _abort_all(self, holders: list[tuple[Worker, str]], part: Job) -> None:
        for worker, kind in holders:
            self.stubs.abort(worker, kind, part.worker_request_id)
        holders.clear()


def _continuation(job: Job, emitted: list[int], attempt: int) -> Job:
    """The request as attempt `attempt` sends it: after a migration, the tokens already streamed
    join the prompt and count against max_tokens (greedy output is unchanged by the move)."""
    if attempt == 1:
        return job
    params = dataclasses.replace(job.params, max_tokens=job.params.max_tokens - len(emitted))
    return dataclasses.replace(job, worker_request_id=f"{job.worker_request_id}.{attempt}",
                               token_ids=job.token_ids + emitted, params=params)

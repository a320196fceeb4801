"""A live move: a request whose decode stream paused (its worker parked its KV) continues on
another decode worker without recomputing anything — reserve there, have the source send the
parked KV into the reservation (MigrateOut answers after the target acknowledged and the source
freed it), then decode there from the last token streamed, as if a prefill worker had sampled it.

No target with room (or none reachable): the request resumes where it was. The move itself
failing (the target or the source died, the transfer broke): the source has freed its KV, the
caller aborts what is held, and the request recomputes once elsewhere (a retryable error)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import grpc

from common.convert import sampling_to_proto
from kv_transfer.selection import TransportRefused
from pdserve_proto import pdserve_pb2 as pb
from router.fleet.registry import Role, Worker
from router.frontdoor.validation import Job
from router.metrics import RouterMetrics
from router.policy.placement import PlacementPolicy
from router.request.calls import CallScope, RouterError
from router.request.events import Finished, handover
from router.request.transfer_secret import transfer_secret
from router.request.worker_client import WorkerStubs

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 5.0
RESUMED_HOLD_S = 5.0  # a request that found nowhere to go is not asked to move again this soon


@dataclass
class StreamSite:
    """Where a request's decode stream runs, what its attempt holds on which workers, and what
    it streamed in this attempt."""

    worker: Worker
    holders: list[tuple[Worker, str]]
    emitted: list[int] = field(default_factory=list)
    last_logprob: pb.TokenLogprob | None = None
    last_token_at: float = 0.0  # time.monotonic() of the last token streamed
    paused_at: float = 0.0  # the last token's time before a pause; 0 while streaming
    hold_until: float = 0.0  # time.monotonic() before which no move is asked of it again

    def note_tokens(self, token_ids: list[int], logprobs: list[pb.TokenLogprob]) -> float:
        """Tokens streamed; the seconds the stream stood still for a move before them."""
        self.emitted.extend(token_ids)
        if logprobs:
            self.last_logprob = logprobs[-1]
        now = time.monotonic()
        paused, self.paused_at = (now - self.paused_at if self.paused_at else 0.0), 0.0
        self.last_token_at = now
        return paused


@dataclass(frozen=True)
class Target:
    worker: Worker
    reserve: pb.ReserveResponse
    transport: str
    moved: Job


class LiveMover:
    def __init__(self, placement: PlacementPolicy, stubs: WorkerStubs, metrics: RouterMetrics,
                 lease_s: float):
        self.placement = placement
        self.stubs = stubs
        self.metrics = metrics
        self.lease_s = lease_s

    def move(self, part: Job, site: StreamSite, cause: str, scope: CallScope,
             end: Finished) -> pb.DecodeRequest:
        """The Decode call that continues the paused request: on a target holding its KV now,
        or (nowhere to go) where it was. `site` follows the request."""
        site.paused_at = site.last_token_at or time.monotonic()
        source = site.worker
        if not site.emitted:  # the worker pauses only what streamed a token; never happens
            raise RouterError(grpc.StatusCode.UNAVAILABLE, f"decode worker {source.worker_id} "
                              "paused a request before its first token", retryable=True)
        target = self._target(part, site, scope)
        if target is None:
            self.metrics.live_migrations.labels(cause, "resumed").inc()
            site.hold_until = time.monotonic() + RESUMED_HOLD_S
            return pb.DecodeRequest(request_id=part.worker_request_id, resume=True)
        site.holders.append((target.worker, "decode"))
        reply = self._migrate_out(part, site, target, cause, scope)
        # The source freed it (a decode stream, or a sample that forked there).
        site.holders[:] = [h for h in site.holders if h[0] is not source]
        site.worker = target.worker
        end.live_migrations += 1
        end.live_migration_bytes += reply.kv_transfer_bytes
        end.tensor_parallel = (end.tensor_parallel[0], target.worker.tensor_parallel_size)
        self.metrics.live_migrations.labels(cause, "moved").inc()
        self.metrics.live_migration_bytes.labels(reply.kv_transport).inc(reply.kv_transfer_bytes)
        log.info("request %s moved from %s to %s (%s): %d bytes by %s in %.3fs",
                 part.request_id, source.worker_id, target.worker.worker_id, cause,
                 reply.kv_transfer_bytes, reply.kv_transport, reply.kv_transfer_s)
        message = pb.DecodeRequest(request_id=part.worker_request_id,
                                   first_token_id=site.emitted[-1])
        if site.last_logprob is not None:
            message.first_logprob.CopyFrom(site.last_logprob)
        return message

    def _migrate_out(self, part: Job, site: StreamSite, target: Target, cause: str,
                     scope: CallScope) -> pb.MigrateOutResponse:
        source = site.worker
        try:
            return scope.unary(self.stubs.decode(source).MigrateOut, pb.MigrateOutRequest(
                request_id=part.worker_request_id, transfer=target.reserve.transfer,
                kv_transport=target.transport, transfer_secret=transfer_secret(target.moved)),
                f"moving the KV to {target.worker.worker_id}", source.worker_id)
        except RouterError as exc:
            self.metrics.live_migrations.labels(cause, "failed").inc()
            if exc.code not in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                # The source freed the KV (or died with it): the request recomputes elsewhere.
                exc.retryable = True
                transfer_failed = exc.worker_code is grpc.StatusCode.ABORTED
                exc.suspect = target.worker.worker_id if transfer_failed else source.worker_id
            raise

    def _target(self, part: Job, site: StreamSite, scope: CallScope) -> Target | None:
        """A decode worker other than the source that reserved room for the moved KV; None when
        none can (full, unreachable, or no transport from the source)."""
        moved = handover(part, site.emitted)
        total = len(moved.token_ids) + moved.params.max_tokens
        keys = self.placement.keys(moved.token_ids)
        exclude = {site.worker.worker_id}
        while True:
            placed = self.placement.place_decode(total, frozenset(exclude), (Role.DECODE,),
                                                 keys=keys)
            if placed is None:
                return None
            worker, charge = placed
            exclude.add(worker.worker_id)
            try:
                transport = self.placement.transport(site.worker, worker)
                reply = scope.unary(self.stubs.decode(worker).Reserve, pb.ReserveRequest(
                    request_id=part.worker_request_id, prompt_token_ids=moved.token_ids,
                    sampling=sampling_to_proto(moved.params),
                    transfer_secret=transfer_secret(moved),
                    lease_s=max(self.lease_s, scope.timeout() + LEASE_MARGIN_S)),
                    "reserve for a move", worker.worker_id)
            except TransportRefused:
                continue
            except RouterError as exc:
                if exc.code is not grpc.StatusCode.RESOURCE_EXHAUSTED:  # it may have been made
                    self.stubs.abort(worker, "decode", part.worker_request_id)
                if exc.code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise
                log.info("move of %s: %s", part.request_id, exc.message)
                continue
            finally:
                self.placement.release(charge)
            self.placement.expect(worker.worker_id, keys)
            return Target(worker, reply, transport, moved)

"""A request's path through the cluster: reserve on a decode worker, prefill (which ships the KV),
then stream the decode worker's tokens — or, in colocated mode, one worker does it all.

Worker failures do not fail the request: a failed prefill (the worker died, or the KV transfer
broke) is retried on another worker with a fresh reservation, and a decode worker dying
mid-stream makes the request migrate — it is prefilled again with the prompt plus every token
already streamed, so the client sees neither a duplicate nor a gap. A decode stream that pauses
(a drain or a rebalance asked its worker to: router.request.move_trigger) moves with its KV to
another decode worker and goes on from there (router.request.moving). Every attempt aborts what
it holds on any path but success. Yields domain events; the servicer turns them into proto."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import grpc

from common.convert import sampling_to_proto
from kv_transfer.selection import TransportRefused
from pdserve_proto import pdserve_pb2 as pb
from router.fleet.registry import Role, Worker
from router.frontdoor.validation import Job
from router.metrics import RouterMetrics
from router.policy.moves import LiveStream
from router.policy.placement import Charge, PlacementPolicy, Suspects
from router.policy.prefill_site import PrefillSitePolicy
from router.request.calls import CallScope, LostWorkers, RouterError
from router.request.events import Finished, Paused, Tokens, continuation, decode_events
from router.request.forks import ForkSource
from router.request.live_streams import LiveStreams
from router.request.moving import LiveMover, StreamSite
from router.request.stream_driver import WAITING, Waiting
from router.request.transfer_secret import transfer_secret
from router.request.worker_client import WorkerStubs

log = logging.getLogger(__name__)
LEASE_MARGIN_S = 5.0
MAX_ATTEMPTS = 4  # per request: the first try plus retries and migrations
PLACEMENT_POLL_S = 0.05  # how often a request waiting for KV room looks again


class Orchestrator:
    def __init__(self, placement: PlacementPolicy, stubs: WorkerStubs, metrics: RouterMetrics,
                 lease_s: float = 30.0, max_attempts: int = MAX_ATTEMPTS,
                 sites: PrefillSitePolicy | None = None):
        self.placement = placement
        self.sites = sites or PrefillSitePolicy()
        self.registry = placement.registry
        self.stubs = stubs
        self.metrics = metrics
        self.lease_s = lease_s
        self.max_attempts = max_attempts
        # The reaper abandons the calls in flight to the workers it drops.
        self.lost = LostWorkers(lambda worker_id: self.registry.get(worker_id) is not None)
        self.streams = LiveStreams()  # what a drain or a rebalance may move
        self.mover = LiveMover(placement, stubs, metrics, lease_s)

    def run(self, job: Job, scope: CallScope) -> Iterator[Tokens | Finished | Waiting]:
        emitted: list[int] = []
        scope.lost = self.lost
        suspects = Suspects(self.registry.heartbeat_timeout_s)
        end = Finished(pb.FINISH_REASON_UNSPECIFIED, "")
        for attempt in range(1, self.max_attempts + 1):
            end.attempts = attempt
            if len(emitted) >= job.params.max_tokens:  # lost only the finish message
                end.finish_reason = pb.FINISH_REASON_LENGTH
                yield end
                return
            part = continuation(job, emitted, attempt)
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
                if emitted and job.fork is not None:  # its continuation holds no prompt
                    job.fork.group.give_up()
                (self.metrics.migrations if emitted else self.metrics.retries).inc()
                log.warning("request %s: %s; %s (attempt %d)", job.request_id, exc.message,
                            "migrating" if emitted else "retrying", attempt + 1)

    def _attempt(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished
                 ) -> Iterator[Tokens | Finished | Waiting]:
        forked = self._fork_site(part, scope, suspects)
        if forked is not None:  # a sample of n: from the first sample's prompt, where it is
            worker, source_id = forked
            charge = self.placement.charge_decode(worker, len(part.token_ids)
                                                  + part.params.max_tokens)
            yield from self._whole(part, worker, charge, scope, end, "fork", fork_of=source_id)
            return
        keys = self.placement.keys(part.token_ids)
        if self._exists(Role.PREFILL) and self._exists(Role.DECODE):
            yield from self._disaggregated(part, scope, suspects, end, keys)
        elif self._exists(Role.COLOCATED):
            worker, charge = self._place(Role.COLOCATED, part, scope, suspects, keys)
            self.placement.expect(worker.worker_id, keys)
            yield from self._whole(part, worker, charge, scope, end, "colocated")
        else:
            raise RouterError(grpc.StatusCode.UNAVAILABLE,
                              "no healthy workers: need a prefill and a decode worker, or a "
                              "colocated one")

    def _fork_site(self, part: Job, scope: CallScope, suspects: Suspects
                   ) -> tuple[Worker, str] | None:
        """For a sample that forks (router.request.forks): the worker holding its prompt and the
        leader's id there, when the leader published one and that worker is still placeable."""
        fork = part.fork
        if fork is None or fork.leads:
            return None
        source = fork.group.wait(scope)  # settled already when the front door waited
        if source is None or source.worker_id in suspects.current():
            return None
        roles = (Role.DECODE, Role.COLOCATED)
        worker = next((w for w in self.registry.placeable(lambda r: r in roles)
                       if w.worker_id == source.worker_id), None)
        return None if worker is None else (worker, source.request_id)

    @staticmethod
    def _leading(part: Job, worker: Worker, message: pb.DecodeRequest,
                 on_first: Callable[[], None] | None) -> Callable[[], None] | None:
        """A leader's Decode asks the worker to hold its prompt for its samples, and its first
        chunk (the prompt is held by then) tells them where (router.request.forks)."""
        fork = part.fork
        if fork is None or not fork.leads:
            return on_first
        message.forks = fork.group.followers

        def first() -> None:
            fork.group.publish(ForkSource(worker.worker_id, message.request_id))
            if on_first is not None:
                on_first()

        return first

    def _exists(self, role: Role) -> bool:
        return bool(self.registry.placeable(lambda r: r is role))

    def _place(self, role: Role, part: Job, scope: CallScope, suspects: Suspects,
               keys: list[int]) -> tuple[Worker, Charge]:
        """A worker of `role` with room for the request, waiting (within the deadline) for one."""
        total = len(part.token_ids) + part.params.max_tokens
        while True:
            if role is Role.DECODE:
                unpairable = self.placement.unpairable()
                if unpairable is not None:  # waiting cannot help: the placement is wrong
                    raise RouterError(grpc.StatusCode.FAILED_PRECONDITION, unpairable)
            placed = self.placement.place_decode(total, suspects.current(), (role,),
                                                 paired=role is Role.DECODE, keys=keys)
            if placed is not None:
                return placed
            self._wait_for_room(role, total, scope, suspects)

    # ---- disaggregated ---------------------------------------------------------------------
    def _disaggregated(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished,
                       keys: list[int]) -> Iterator[Tokens | Finished | Waiting]:
        while True:
            decode, charge = self._place(Role.DECODE, part, scope, suspects, keys)
            decision = self.sites.decide(self.placement.site_inputs(
                len(part.token_ids), decode, suspects.current(), keys))
            self.placement.expect(decode.worker_id, keys)  # it will hold the prompt's KV
            self.metrics.prefill_sites.labels(decision.site, decision.reason).inc()
            log.debug("request %s on %s: %s", part.request_id, decode.worker_id,
                      decision.describe())
            if decision.local:
                tokens = self.sites.local_tokens(decision.inputs)
                yield from self._whole(part, decode, charge, scope, end, "decode",
                                       self.placement.charge_prefill(decode, tokens))
                return
            holders: list[tuple[Worker, str]] = []
            reserve = self._reserve(part, scope, decode, charge, holders)
            if reserve is not None:
                break
        yield from self._remote(part, scope, suspects, end, keys, (decode, charge, reserve),
                                holders)

    def _remote(self, part: Job, scope: CallScope, suspects: Suspects, end: Finished,
                keys: list[int], reserved: tuple[Worker, Charge, pb.ReserveResponse],
                holders: list[tuple[Worker, str]]) -> Iterator[Tokens | Finished | Waiting]:
        """Prefill on a prefill worker, which ships the KV into the reservation; then decode."""
        decode, charge, reserve = reserved
        end.prefill_site = "remote"
        done = False
        try:
            try:
                first = self._prefill(part, scope, suspects, decode, reserve, holders, end, keys)
            finally:
                self.placement.release(charge)
            prefill = next(w for w, kind in reversed(holders) if kind == "prefill")
            end.tensor_parallel = (prefill.tensor_parallel_size, decode.tensor_parallel_size)
            yield Tokens([first.first_token_id],
                         [first.first_logprob] if first.HasField("first_logprob") else [],
                         list(first.prompt_logprobs))
            if first.finish_reason != pb.FINISH_REASON_UNSPECIFIED:
                if part.fork is not None:  # no Decode: its prompt is held nowhere
                    part.fork.group.give_up()
                done = True
                self._abort_all(holders, part)  # free the reservation nobody will use
                end.finish_reason, end.stop_reason = first.finish_reason, first.stop_reason
                yield end
                return
            message = pb.DecodeRequest(request_id=part.worker_request_id,
                                       first_token_id=first.first_token_id)
            site = StreamSite(decode, holders, [first.first_token_id])
            if first.HasField("first_logprob"):
                message.first_logprob.CopyFrom(first.first_logprob)
                site.last_logprob = first.first_logprob
            for item in self._stream(part, site, message, scope, end,
                                     self._leading(part, decode, message, None)):
                done = isinstance(item, Finished)
                yield item
        finally:
            if not done:  # cancel, deadline or failure: nothing may stay allocated
                self._abort_all(holders, part)

    def _reserve(self, part: Job, scope: CallScope, decode: Worker, charge: Charge,
                 holders: list[tuple[Worker, str]]) -> pb.ReserveResponse | None:
        """Blocks on the decode worker for the prompt's KV; None when it had no room after all
        (the router's view was stale: place again)."""
        try:
            reply = scope.unary(self.stubs.decode(decode).Reserve, pb.ReserveRequest(
                request_id=part.worker_request_id, prompt_token_ids=part.token_ids,
                sampling=sampling_to_proto(part.params), transfer_secret=transfer_secret(part),
                # The router aborts the reservation on every failure path it sees; the lease
                # is the backstop for what it cannot see (its own death), so it lasts as long
                # as the request may: KV arriving after the deadline is useless anyway.
                lease_s=max(self.lease_s, scope.timeout() + LEASE_MARGIN_S)), "reserve",
                decode.worker_id)
        except RouterError as exc:
            self.placement.release(charge)
            if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # our view was stale
                scope.pause(PLACEMENT_POLL_S)
                return None
            # Cancelled, past its deadline or failed in flight, the Reserve may still have been
            # made there (it waits for the worker's step): nobody else would free it.
            self.stubs.abort(decode, "decode", part.worker_request_id)
            exc.suspect = decode.worker_id
            raise
        holders.append((decode, "decode"))
        return reply

    def _prefill(self, part: Job, scope: CallScope, suspects: Suspects, decode: Worker,
                 reserve: pb.ReserveResponse, holders: list[tuple[Worker, str]], end: Finished,
                 keys: list[int]) -> pb.PrefillResponse:
        while True:
            placed = self.placement.place_prefill(len(part.token_ids), suspects.current(),
                                                  (Role.PREFILL,), decode, keys)
            if placed is None:
                self._wait_for_room(Role.PREFILL, 0, scope, suspects)
                continue
            prefill, charge = placed
            try:
                transport = self.placement.transport(prefill, decode)
            except TransportRefused:  # broken by another request since it was placed
                self.placement.release(charge)
                continue
            started = time.monotonic()
            holders.append((prefill, "prefill"))
            try:
                first = scope.unary(self.stubs.prefill(prefill).Prefill, pb.PrefillRequest(
                    request_id=part.worker_request_id, prompt_token_ids=part.token_ids,
                    sampling=sampling_to_proto(part.params), transfer=reserve.transfer,
                    kv_transport=transport, transfer_secret=transfer_secret(part)),
                    "prefill", prefill.worker_id)
            except RouterError as exc:
                if exc.code is grpc.StatusCode.RESOURCE_EXHAUSTED:  # its queue is full
                    holders.pop()
                    scope.pause(PLACEMENT_POLL_S)
                    continue
                if exc.worker_code is grpc.StatusCode.FAILED_PRECONDITION:
                    # This pair can never move KV by this transport: not again; try another
                    # transport or pair.
                    self.placement.mark_broken(prefill, decode, transport, exc.message)
                    exc.retryable = True
                    raise
                # ABORTED: the prefill worker is fine but its KV did not reach the decode one.
                transfer_failed = exc.worker_code is grpc.StatusCode.ABORTED
                exc.suspect = decode.worker_id if transfer_failed else prefill.worker_id
                raise
            finally:
                self.placement.release(charge)
            end.prefill_started = end.prefill_started or started
            end.note_prefill(first)
            transport = first.kv_transport or "none"
            self.metrics.kv_transfer_bytes.labels(transport).inc(first.kv_transfer_bytes)
            self.metrics.kv_transfer_seconds.labels(transport).inc(first.kv_transfer_s)
            return first

    # ---- one worker prefills and decodes -----------------------------------------------------
    def _whole(self, part: Job, worker: Worker, charge: Charge, scope: CallScope, end: Finished,
               kind: str, prefill_charge: Charge | None = None, fork_of: str = ""
               ) -> Iterator[Tokens | Finished | Waiting]:
        """The whole generation on one worker: a colocated one, a decode worker prefilling the
        prompt itself (conditional disaggregation), or a sample of n forking from the first
        sample's prompt there (`fork_of`; its first chunk says whether it could). Its charges
        end at the first token."""
        end.prefill_started = end.prefill_started or time.monotonic()
        end.prefill_site = "local" if kind in ("decode", "fork") else kind
        end.tensor_parallel = (worker.tensor_parallel_size,) * 2
        message = pb.DecodeRequest(request_id=part.worker_request_id,
                                   prompt_token_ids=part.token_ids,
                                   sampling=sampling_to_proto(part.params), fork_of=fork_of)

        charges = [c for c in (charge, prefill_charge) if c is not None]

        def release() -> None:
            while charges:
                self.placement.release(charges.pop())

        done = False
        counted = kind != "fork"  # a sample's site is known at its first chunk
        site = StreamSite(worker, [(worker, kind)])
        try:
            for item in self._stream(part, site, message, scope, end,
                                     self._leading(part, worker, message, release)):
                if not counted and item is not WAITING:
                    self.metrics.prefill_sites.labels(end.prefill_site, "sample of n").inc()
                    counted = True
                done = isinstance(item, Finished)
                yield item
        finally:
            release()
            if not done:
                self._abort_all(site.holders, part)

    # ---- shared ----------------------------------------------------------------------------
    def _stream(self, part: Job, site: StreamSite, message: pb.DecodeRequest,
                scope: CallScope, end: Finished, on_first: Callable[[], None] | None = None
                ) -> Iterator[Tokens | Finished | Waiting]:
        """The request's decode stream, following it wherever a live move takes it."""
        once = _Once(on_first)
        continuing = False
        while True:
            cause = yield from self._stream_once(part, site, message, scope, end, once,
                                                 continuing)
            if cause is None:
                return
            message = self.mover.move(part, site, cause, scope, end)
            continuing = True

    def _stream_once(self, part: Job, site: StreamSite, message: pb.DecodeRequest,
                     scope: CallScope, end: Finished, on_first: Callable[[], None],
                     continuing: bool) -> Iterator[Tokens | Finished | Waiting]:
        """One Decode call's events; returns the cause of the move when it paused (else None)."""
        worker, rid = site.worker, part.worker_request_id
        self.streams.open(LiveStream(
            rid, worker.worker_id, len(part.token_ids) + len(site.emitted),
            part.params.max_tokens - len(site.emitted),
            movable=worker.role is Role.DECODE and part.params.structured_output is None,
            not_before=site.hold_until))
        try:
            call = scope.track(self.stubs.decode_stream(worker, message, scope.timeout()))
            with scope.watching(worker.worker_id, call, f"decode on {worker.worker_id}"):
                for event in decode_events(worker.worker_id, call, message, scope, end,
                                           on_first, continuing):
                    if isinstance(event, Paused):
                        return self.streams.close(rid) or "drain"
                    if isinstance(event, Tokens):
                        self._note_tokens(rid, site, event, end)
                    yield event
        finally:
            self.streams.close(rid)
        return None

    def _note_tokens(self, request_id: str, site: StreamSite, tokens: Tokens,
                     end: Finished) -> None:
        paused_s = site.note_tokens(tokens.token_ids, tokens.logprobs)
        if paused_s:
            end.live_migration_pause_s += paused_s
            self.metrics.live_migration_pause.observe(paused_s)
        self.streams.grow(request_id, len(tokens.token_ids))

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


class _Once:
    """A callback run at most once, however many streams a moved request reads."""

    def __init__(self, fn: Callable[[], None] | None):
        self._fn = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()

"""The decode worker's policy over the shared engine loop: reservations under leases, KV arrival
(through its receiver connectors and `arrivals`), admission into the running batch, colocated
generation, and running requests leaving with their KV (`departures`, through its sender
connectors). Every engine access runs on the loop thread (through `loop.call`); KV bytes land on
the connectors' threads, into reserved blocks only."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Protocol

from decode_worker.arrivals import KVArrivals, num_cached_blocks
from decode_worker.departures import Departures, Paused
from decode_worker.output_sessions import OutputSessions, QueueSink
from decode_worker.reservations import ReservationTable
from engine.engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from kv_transfer import (
    KVReceiveConnector,
    KVSendConnector,
    ReservationBook,
    Transfer,
    TransferDescriptor,
    TransferStats,
)
from kv_transfer.connector import GrpcService, OnRefused, receiver_identity
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions
from serving.worker_params import worker_params

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0  # a loop command waits at most one long step plus the queue ahead


class NoRoom(Exception):
    """Not enough free KV blocks for the reservation."""


class OutputSink(Protocol):
    """Where one request's outputs go (decode_worker.output_sessions); `put` runs on the loop
    thread."""

    def note_admission(self, seconds: float) -> None: ...

    def put(self, item: RequestOutput | Paused | BaseException) -> None: ...


# Builds the worker's receiver connectors over its ReservationBook (kv_transfer.connectors).
ConnectReceivers = Callable[[ReservationBook, OnRefused], list[KVReceiveConnector]]


def no_receivers(book: ReservationBook, on_refused: OnRefused) -> list[KVReceiveConnector]:
    return []  # a colocated worker: no KV arrives


class DecodePolicy:
    def __init__(self, table: ReservationTable, departures: Departures,
                 hand_over: Callable[[str, Paused], None]):
        self.table = table
        self.departures = departures
        self.hand_over = hand_over

    def before_step(self, engine: LLMEngine) -> None:
        engine.expire_held()  # prompts held for forks that never came (engine.forks)
        for request_id in self.table.expire():
            log.warning("reservation of %s expired before its KV arrived; blocks freed",
                        request_id)
        self.departures.settle(engine, self.hand_over)
        self.departures.expire(engine)

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        pass


class DecodeWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions,
                 connect: ConnectReceivers = no_receivers,
                 senders: Mapping[str, KVSendConnector] | None = None):
        self.options = options
        self.worker_id = options.worker_id
        # Transfers begin and end on the connectors' threads; freeing blocks is the loop's job.
        self.table = ReservationTable(
            release=lambda request: self.loop.post(lambda e: e.release(request)))
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load,
                                     options.tensor_parallel_size)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        self.departures = Departures()
        self.loop = EngineLoop(engine, DecodePolicy(self.table, self.departures,
                                                    lambda rid, m: self.loop.hand_over(rid, m)),
                               observer=self.metrics)
        # The routers' Outputs streams: each sends a step's outputs at once, after the step.
        self.sessions = OutputSessions()
        self.loop.on_step_delivered = self.sessions.wake_all
        self.arrivals = KVArrivals(self.table, engine, self.metrics)
        self.receivers = connect(self.arrivals, self.gate.note_refused)
        self.senders = dict(senders or {})  # by transport: running requests' KV leaving
        self.dtype = str(engine.dtype).removeprefix("torch.")

    def kv_services(self) -> list[GrpcService]:
        return [service for c in self.receivers for service in c.services()]

    def bind(self, address: str) -> None:
        """The worker's gRPC server listens at `address`: tell the connectors."""
        for connector in self.receivers:
            connector.bind(address)

    def kv_receiver_id(self) -> str:
        return receiver_identity(self.receivers)

    # ---- disaggregated path ----------------------------------------------------------------
    def reserve(self, request_id: str, token_ids: list[int], params: SamplingParams,
                lease_s: float, secret: str = "") -> TransferDescriptor:
        """Blocks for the prompt's KV, described for its sender (ValueError on bad input,
        NoRoom when the blocks do not fit right now)."""
        self.loop.engine.prepare_constraint(params)  # here, not on the step loop's thread

        def run(engine: LLMEngine) -> TransferDescriptor:
            if request_id in self.table:
                raise ValueError(f"request_id {request_id!r} already holds a reservation")
            request = engine.new_request(token_ids, worker_params(params), request_id)
            if not engine.reserve(request):
                raise NoRoom(f"{engine.block_manager.blocks_needed(len(token_ids))} KV blocks "
                             f"needed, {engine.block_manager.num_free_blocks} free")
            self.table.add(request, lease_s, secret)
            cached = num_cached_blocks(engine, request)
            return TransferDescriptor(self.worker_id, tuple(request.block_ids[cached:]), cached,
                                      {c.transport: dict(c.endpoint()) for c in self.receivers})

        return self.loop.call(run, COMMAND_TIMEOUT_S)

    def admit(self, request_id: str, first_token: int, logprobs: dict[int, float] | None,
              forks: int = 0) -> tuple[float, Iterator[RequestOutput | Paused]]:
        """Start decoding a request whose KV arrived: the seconds until it joined the batch
        (the loop finishing its step), and its outputs (first token first). `forks`: samples
        of its prompt that will fork from its KV (its prompt's blocks are held for them)."""
        sink = QueueSink()
        self.start_admitted(request_id, first_token, logprobs, forks, sink)
        return sink.admission_s, sink.drain()

    def start_admitted(self, request_id: str, first_token: int,
                       logprobs: dict[int, float] | None, forks: int, sink: OutputSink) -> None:
        """`admit`, its outputs (and admission time) handed to `sink`."""
        _check_forks(forks)
        called = time.monotonic()

        def run(engine: LLMEngine) -> None:
            request = self.table.take_ready(request_id)
            request.forks_expected = forks
            sink.note_admission(time.monotonic() - called)
            self.loop.sinks[request_id] = sink.put
            first = engine.admit_prefilled(request, first_token, logprobs)
            if first.finished:  # the caller already has the first token; only the end is news
                self.loop.deliver(dataclasses.replace(first, new_token_ids=[], new_text=""))

        self.loop.call(run, COMMAND_TIMEOUT_S)

    # ---- colocated path --------------------------------------------------------------------
    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 forks: int = 0, fork_of: str = "") -> Iterator[RequestOutput | Paused]:
        """The whole generation on this worker (prefill + decode): the colocated baseline.
        `forks`: samples of its prompt that will fork from it; `fork_of`: this is such a sample,
        of that request's prompt (engine.forks) — it prefills the prompt itself when nothing is
        held for it."""
        sink = QueueSink()
        self.start_generation(request_id, token_ids, params, sink, forks, fork_of)
        return sink.drain()

    def start_generation(self, request_id: str, token_ids: list[int], params: SamplingParams,
                         sink: OutputSink, forks: int = 0, fork_of: str = "") -> None:
        """`generate`, its outputs handed to `sink`."""
        _check_forks(forks)
        self.loop.engine.prepare_constraint(params)  # here, not on the step loop's thread

        def run(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, worker_params(params), request_id)
            request.forks_expected = forks
            if fork_of and engine.fork(request, fork_of):
                self.loop.sinks[request_id] = sink.put
                return
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            self.loop.sinks[request_id] = sink.put
            engine.scheduler.add(request)

        self.loop.call(run, COMMAND_TIMEOUT_S)

    # ---- a running request moving to another decode worker ---------------------------------
    def pause(self, request_ids: list[str], lease_s: float) -> list[str]:
        """Take these running requests out of the batch to move them (the ids that will pause:
        each one's stream then ends with `Paused`, its KV parked for `lease_s`)."""
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        return self.loop.call(lambda e: self.departures.pause(e, request_ids, lease_s),
                              COMMAND_TIMEOUT_S)

    def resume(self, request_id: str) -> Iterator[RequestOutput | Paused]:
        """A parked request decodes here again: its outputs from the next token on (KeyError:
        nothing parked by that id)."""
        sink = QueueSink()
        self.start_resumed(request_id, sink)
        return sink.drain()

    def start_resumed(self, request_id: str, sink: OutputSink) -> None:
        """`resume`, its outputs handed to `sink`."""
        def run(engine: LLMEngine) -> None:
            self.departures.resume(engine, request_id)
            self.loop.sinks[request_id] = sink.put

        self.loop.call(run, COMMAND_TIMEOUT_S)

    def migrate_out(self, request_id: str, transport: str, descriptor: TransferDescriptor,
                    secret: str) -> TransferStats:
        """Send a parked request's KV into another decode worker's reservation and free it here
        once that worker acknowledged (or the transfer failed: TransferError). ValueError: the
        transport or descriptor cannot serve (it stays parked); KeyError: nothing parked."""
        connector = self.senders.get(transport)
        if connector is None:
            raise ValueError(f"kv_transport {transport!r} is not one this worker sends KV over "
                             f"(it sends over: {', '.join(sorted(self.senders)) or 'none'})")
        descriptor.endpoint(transport)
        transfer = Transfer(request_id, transport, descriptor, secret, self.dtype)

        def take(engine: LLMEngine) -> list[int]:
            return _blocks_to_send(engine, self.departures, request_id, descriptor)

        def shipped() -> None:  # posted: it must happen even when the loop is slow to answer
            self.loop.post(lambda e: self.departures.shipped(e, request_id))

        try:
            blocks = self.loop.call(take, COMMAND_TIMEOUT_S)
        except TimeoutError:  # `take` may have run after all: the request is then shipping
            shipped()
            raise
        started = time.perf_counter()
        try:
            send = connector.begin(transfer)
            time.sleep(self.options.fault_move_pause_s)  # tests only: a window mid-move
            sent = send.finish(blocks)
        except Exception:
            self.metrics.transfer_failed("sent", transport)
            raise
        finally:  # acknowledged or failed: nothing reads its blocks any more
            shipped()
        stats = TransferStats(sent.num_bytes, time.perf_counter() - started, sent.transport)
        self.metrics.transfer("sent", stats.num_bytes, stats.seconds, stats.transport)
        return stats

    # ---- both ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        return self.loop.call(lambda e: self._abort_on_loop(e, request_id), COMMAND_TIMEOUT_S)

    def _abort_on_loop(self, engine: LLMEngine, request_id: str) -> bool:
        found = self.departures.abort(engine, request_id)
        found = self.table.abort(request_id) or found
        if engine.abort(request_id) is not None:
            self.loop.deliver(RuntimeError("aborted"), request_id)
            found = True
        return found

    def abort_later(self, request_id: str) -> None:
        """Abort without waiting (safe from gRPC callbacks)."""
        self.loop.post(lambda e: self._abort_on_loop(e, request_id))

    def in_flight(self) -> int:
        """Requests reserved, receiving, waiting or decoding here (drain waits for 0)."""
        return self.loop.call(lambda e: self.loop.num_in_flight() + len(self.table)
                              + len(self.departures), COMMAND_TIMEOUT_S)

    def close(self) -> None:
        for connector in self.receivers:
            connector.close()
        self.loop.stop()
        for sender in self.senders.values():
            sender.close()


MAX_FORKS = 1023  # samples forking from one prompt (the router sends at most MAX_CHOICES - 1)


def _check_forks(forks: int) -> None:
    if forks > MAX_FORKS:
        raise ValueError(f"forks must be <= {MAX_FORKS}, got {forks}")


def _blocks_to_send(engine: LLMEngine, departures: Departures, request_id: str,
                    descriptor: TransferDescriptor) -> list[int]:
    """A parked request's blocks for `descriptor` (after the target's cached ones), checked to
    cover exactly its computed positions, and the request marked as shipping."""
    request = departures.peek(request_id)
    if request.num_computed_tokens != request.num_known_tokens - 1:
        raise ValueError(f"transfer: request {request_id}'s KV covers "
                         f"{request.num_computed_tokens} positions, not the "
                         f"{request.num_known_tokens - 1} before its last token")
    needed = engine.block_manager.blocks_needed(request.num_computed_tokens)
    cached, fresh = descriptor.num_cached_blocks, len(descriptor.block_ids)
    if cached + fresh != needed:
        raise ValueError(f"transfer: {cached} cached + {fresh} reserved blocks, but request "
                         f"{request_id}'s {request.num_computed_tokens} computed positions fill "
                         f"{needed}")
    departures.ship(request_id)
    return request.block_ids[cached:needed]

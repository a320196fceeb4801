"""The decode worker's policy over the shared engine loop: reservations under leases, KV arrival
(through its receiver connectors and `arrivals`), admission into the running batch, and colocated
generation. Every engine access runs on the loop thread (through `loop.call`); KV bytes land on
the connectors' threads, into reserved blocks only."""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable, Iterator

from decode_worker.arrivals import KVArrivals, num_cached_blocks
from decode_worker.reservations import ReservationTable
from engine.engine import LLMEngine, RequestOutput
from engine.request import SamplingParams
from kv_transfer import KVReceiveConnector, ReservationBook, TransferDescriptor
from kv_transfer.connector import GrpcService, OnRefused, receiver_identity
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0  # a loop command waits at most one long step plus the queue ahead


class NoRoom(Exception):
    """Not enough free KV blocks for the reservation."""


# Builds the worker's receiver connectors over its ReservationBook (kv_transfer.connectors).
ConnectReceivers = Callable[[ReservationBook, OnRefused], list[KVReceiveConnector]]


def no_receivers(book: ReservationBook, on_refused: OnRefused) -> list[KVReceiveConnector]:
    return []  # a colocated worker: no KV arrives


class DecodePolicy:
    def __init__(self, table: ReservationTable):
        self.table = table

    def before_step(self, engine: LLMEngine) -> None:
        engine.expire_held()  # prompts held for forks that never came (engine.forks)
        for request_id in self.table.expire():
            log.warning("reservation of %s expired before its KV arrived; blocks freed",
                        request_id)

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        pass


class DecodeWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions,
                 connect: ConnectReceivers = no_receivers):
        self.options = options
        self.worker_id = options.worker_id
        # Transfers begin and end on the connectors' threads; freeing blocks is the loop's job.
        self.table = ReservationTable(
            release=lambda request: self.loop.post(lambda e: e.release(request)))
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load,
                                     options.tensor_parallel_size)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        self.loop = EngineLoop(engine, DecodePolicy(self.table), observer=self.metrics)
        self.arrivals = KVArrivals(self.table, engine, self.metrics)
        self.receivers = connect(self.arrivals, self.gate.note_refused)

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
            request = engine.new_request(token_ids, params, request_id)
            if not engine.reserve(request):
                raise NoRoom(f"{engine.block_manager.blocks_needed(len(token_ids))} KV blocks "
                             f"needed, {engine.block_manager.num_free_blocks} free")
            self.table.add(request, lease_s, secret)
            cached = num_cached_blocks(engine, request)
            return TransferDescriptor(self.worker_id, tuple(request.block_ids[cached:]), cached,
                                      {c.transport: dict(c.endpoint()) for c in self.receivers})

        return self.loop.call(run, COMMAND_TIMEOUT_S)

    def admit(self, request_id: str, first_token: int, logprobs: dict[int, float] | None,
              forks: int = 0) -> tuple[float, Iterator[RequestOutput]]:
        """Start decoding a request whose KV arrived: the seconds until it joined the batch
        (the loop finishing its step), and its outputs (first token first). `forks`: samples
        of its prompt that will fork from its KV (its prompt's blocks are held for them)."""
        _check_forks(forks)
        outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        called = time.monotonic()

        def run(engine: LLMEngine) -> None:
            request = self.table.take_ready(request_id)
            request.forks_expected = forks
            self.loop.sinks[request_id] = outputs.put
            first = engine.admit_prefilled(request, first_token, logprobs)
            if first.finished:  # the caller already has the first token; only the end is news
                self.loop.deliver(first)

        self.loop.call(run, COMMAND_TIMEOUT_S)
        return time.monotonic() - called, _drain(outputs)

    # ---- colocated path --------------------------------------------------------------------
    def generate(self, request_id: str, token_ids: list[int], params: SamplingParams,
                 forks: int = 0, fork_of: str = "") -> Iterator[RequestOutput]:
        """The whole generation on this worker (prefill + decode): the colocated baseline.
        `forks`: samples of its prompt that will fork from it; `fork_of`: this is such a sample,
        of that request's prompt (engine.forks) — it prefills the prompt itself when nothing is
        held for it."""
        _check_forks(forks)
        outputs: queue.Queue[RequestOutput | BaseException] = queue.Queue()
        self.loop.engine.prepare_constraint(params)  # here, not on the step loop's thread

        def run(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, params, request_id)
            request.forks_expected = forks
            if fork_of and engine.fork(request, fork_of):
                self.loop.sinks[request_id] = outputs.put
                return
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            self.loop.sinks[request_id] = outputs.put
            engine.scheduler.add(request)

        self.loop.call(run, COMMAND_TIMEOUT_S)
        return _drain(outputs)

    # ---- both ------------------------------------------------------------------------------
    def abort(self, request_id: str) -> bool:
        return self.loop.call(lambda e: self._abort_on_loop(e, request_id), COMMAND_TIMEOUT_S)

    def _abort_on_loop(self, engine: LLMEngine, request_id: str) -> bool:
        found = self.table.abort(request_id)
        if engine.abort(request_id) is not None:
            self.loop.deliver(RuntimeError("aborted"), request_id)
            found = True
        return found

    def abort_later(self, request_id: str) -> None:
        """Abort without waiting (safe from gRPC callbacks)."""
        self.loop.post(lambda e: self._abort_on_loop(e, request_id))

    def in_flight(self) -> int:
        """Requests reserved, receiving, waiting or decoding here (drain waits for 0)."""
        return self.loop.call(lambda e: self.loop.num_in_flight() + len(self.table),
                              COMMAND_TIMEOUT_S)

    def close(self) -> None:
        for connector in self.receivers:
            connector.close()
        self.loop.stop()


MAX_FORKS = 1023  # samples forking from one prompt (the router sends at most MAX_CHOICES - 1)


def _check_forks(forks: int) -> None:
    if forks > MAX_FORKS:
        raise ValueError(f"forks must be <= {MAX_FORKS}, got {forks}")


STALL_TIMEOUT_S = 300.0  # no output for this long means the loop is stuck: give up


def _drain(outputs: queue.Queue[RequestOutput | BaseException]) -> Iterator[RequestOutput]:
    while True:
        try:
            item = outputs.get(timeout=STALL_TIMEOUT_S)
        except queue.Empty:
            raise TimeoutError(f"no output for {STALL_TIMEOUT_S:.0f}s") from None
        if isinstance(item, BaseException):
            raise item
        yield item
        if item.finished:
            return

"""The prefill worker's policy over the shared engine loop: queue prompts, and when a request's
first token is sampled, detach it (keeping its blocks), ship its KV to the decode worker, and free
the blocks only after the decode worker acknowledges."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from engine.engine import LLMEngine, RequestOutput
from engine.request import Request, SamplingParams
from kv_transfer import (
    KVPlace,
    KVSender,
    PieceId,
    SharedSender,
    TransferError,
    TransferStats,
    TransportRefused,
    choose_transport,
    device_identity,
    local_host_id,
    pack_blocks,
    piece_mac,
)
from prefill_worker.handoff import DecodeControl, DecodeTarget, PrefillResult, ShipPlan
from prefill_worker.pieces import PieceSender
from prefill_worker.streaming import KVStream, KVStreams
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0


class PrefillWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions, control: DecodeControl):
        self.options = options
        self.worker_id = options.worker_id
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        # Sends to one decode worker run one at a time; the threads let sends to the others
        # proceed meanwhile (a dead receiver fails fast, so none is held for long).
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")
        device = torch.device(options.device)
        self.sender = KVSender(options.worker_id, options.host, device,
                               options.transfer_timeout_s)
        self.shared = SharedSender(options.worker_id, options.transfer_timeout_s,
                                   options.fault_kv_write_pause_s)
        self.place = KVPlace(options.worker_id, local_host_id(), device_identity(device),
                             options.kv_transport)
        self.unmappable: set[str] = set()  # exports that cannot be mapped from here (auto: dist)
        self.control = control
        self.shipping: dict[str, Request] = {}
        self.cancelled: set[str] = set()  # shipping requests aborted before their send began
        self.streams = KVStreams(self.shared, self._executor,
                                 lambda: self.loop.engine.runner.kv_buffer.tensor,
                                 options.transfer_timeout_s, self.metrics.streamed)
        self.loop = EngineLoop(engine, policy=self.streams, observer=self.metrics)

    def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                target: DecodeTarget, timeout_s: float) -> PrefillResult:
        """Compute the prompt, sample the first token and ship the KV (ValueError on bad input,
        TimeoutError past `timeout_s`, TransferError when shipping fails)."""
        done: Future[PrefillResult] = Future()

        def queue(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, params, request_id)
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            needed = engine.block_manager.blocks_needed(len(token_ids))
            if not 0 <= target.num_cached_blocks < needed:
                raise ValueError(f"decode_cached_blocks is {target.num_cached_blocks}; the "
                                 f"prompt has {needed} blocks and the last is always sent")
            if len(target.block_ids) != needed - target.num_cached_blocks:
                raise ValueError(f"decode_block_ids has {len(target.block_ids)} blocks; the "
                                 f"prompt needs {needed - target.num_cached_blocks} after "
                                 f"{target.num_cached_blocks} the decode worker holds")
            self.loop.sinks[request_id] = lambda item: self._on_first(request_id, item, target,
                                                                      done)
            engine.scheduler.add(request)
            self._open_stream(request_id, target)

        self.loop.call(queue, COMMAND_TIMEOUT_S)
        try:
            return done.result(timeout=timeout_s)
        except TimeoutError:
            self.abort(request_id)
            raise

    def _open_stream(self, request_id: str, target: DecodeTarget) -> None:
        """Stream the request's KV chunk by chunk (loop thread; prefill_worker.streaming)."""
        if not self.options.kv_streaming:
            return
        try:
            transport = self.transport_for(target)
        except TransferError:
            return  # shipping reports it
        stream = KVStream(request_id, target.worker_id, target.num_cached_blocks,
                          list(target.block_ids), secret=target.transfer_secret)
        if transport == "shared":
            self.streams.open(stream, target.export_address)
            return
        dtype = str(self.loop.engine.dtype).removeprefix("torch.")
        self.streams.open_dist(stream, PieceSender(
            request_id, lambda layers, first, n: self._send_dist_piece(
                target, request_id, dtype, layers, first, n, more=True)))

    def _send_dist_piece(self, target: DecodeTarget, request_id: str, dtype: str,
                         layers: Sequence[torch.Tensor], first_block: int, num_blocks: int,
                         more: bool) -> TransferStats:
        """Send packed blocks [first_block, +num_blocks) of the request's reservation and wait
        for the decode worker's acknowledgement. Their MAC (under the transfer secret) goes in
        the control call: the decode worker writes only bytes that match it."""
        acks: list[Callable[[float], object]] = []
        mac = piece_mac(target.transfer_secret,
                        PieceId(request_id, first_block, num_blocks, last=not more), layers)
        stats = self.sender.send_packed(
            target.worker_id, target.transfer_address, layers,
            lambda generation, tag: acks.append(self.control.start_receive(
                target, request_id, generation, tag, num_blocks, dtype, first_block, more,
                mac)))
        acks[0](self.options.transfer_timeout_s)  # the decode side has written the KV
        return stats

    def _on_first(self, request_id: str, item: RequestOutput | BaseException,
                  target: DecodeTarget, done: Future[PrefillResult]) -> None:
        """Runs on the loop thread when the request's first token is sampled (or it failed)."""
        if isinstance(item, BaseException) or item.finished:
            self.streams.cancel(request_id)
        if isinstance(item, BaseException):
            done.set_exception(item)
            return
        engine = self.loop.engine
        if item.finished:  # nothing to decode: the blocks are already freed
            done.set_result(self._result(item, None))
            return
        self.loop.sinks.pop(request_id, None)
        stream = self.streams.take(request_id)
        request = engine.detach(request_id)
        self.shipping[request_id] = request
        self._executor.submit(self._ship, request, item, target, done, stream)

    def _ship(self, request: Request, first: RequestOutput, target: DecodeTarget,
              done: Future[PrefillResult], stream: KVStream | None) -> None:
        engine = self.loop.engine
        skip = target.num_cached_blocks
        plan = ShipPlan(request, target, request.block_ids[skip:skip + len(target.block_ids)],
                        str(engine.dtype).removeprefix("torch."), stream)
        transport = "dist"
        try:
            if request.request_id in self.cancelled:
                if stream is not None:
                    self.streams.abandon(stream)
                raise RuntimeError(f"request {request.request_id} aborted before its KV was sent")
            # A streamed request's transfer has begun on its transport: it ends there.
            transport = self.transport_for(target) if stream is None else \
                "dist" if stream.pieces is not None else "shared"
            started = time.perf_counter()
            sent = self._send(plan, transport)
            # The whole hand-over counts (control RPCs, packing, the wait for the decode side's
            # acknowledgement), not only the bytes' flight: it is what the request waits for.
            stats = TransferStats(sent.num_bytes, time.perf_counter() - started, sent.transport)
            self.metrics.transfer("sent", stats.num_bytes, stats.seconds, stats.transport)
            done.set_result(self._result(first, stats))
        except Exception as exc:
            self.metrics.transfer_failed("sent", transport)
            log.warning("shipping KV of %s to %s failed: %s", request.request_id,
                        target.worker_id, exc)
            done.set_exception(exc)
        finally:
            self.loop.post(lambda e: self._release(e, request))

    def transport_for(self, target: DecodeTarget) -> str:
        """The pair's transport (TransferError, permanent, when none can work)."""
        if target.place is None:
            return "dist"
        try:
            transport = choose_transport(self.place, target.place)
        except TransportRefused as exc:
            raise TransferError(str(exc), permanent=True) from exc
        automatic = self.place.mode == target.place.mode == "auto"
        if transport == "shared" and automatic and target.export_address in self.unmappable:
            return "dist"  # one host, but its cache cannot be mapped from here (namespaces)
        return transport

    def _send(self, plan: ShipPlan, transport: str) -> TransferStats:
        if transport == "dist":
            return self._send_dist(plan)
        try:
            return self._send_shared(plan)
        except TransferError as exc:
            automatic = self.place.mode == "auto" and plan.target.place.mode == "auto"
            if not (exc.permanent and automatic):
                raise
            try:  # dist must be possible for this pair too (not two workers on one GPU)
                choose_transport(dataclasses.replace(self.place, mode="dist"), plan.target.place)
            except TransportRefused as refused:
                raise TransferError(f"{exc}; and {refused}", permanent=True) from exc
            log.warning("%s; KV to %s goes over dist instead", exc, plan.target.worker_id)
            self.unmappable.add(plan.target.export_address)
            return self._send_dist(plan)

    def _send_dist(self, plan: ShipPlan) -> TransferStats:
        """The request's blocks, or those its pieces have not sent yet, as the last piece."""
        engine, stream, first = self.loop.engine, plan.stream, 0
        if stream is not None and stream.pieces is not None:
            try:
                stream.pieces.drain(self.options.transfer_timeout_s)
            finally:
                stream.pieces.close()
            first = stream.sent
        blocks = plan.blocks[first:]
        stats = self._send_dist_piece(plan.target, plan.request.request_id, plan.dtype,
                                      pack_blocks(engine.runner.kv_caches, blocks), first,
                                      len(blocks), more=False)
        return TransferStats(stats.num_bytes + first * self._block_bytes(), stats.seconds,
                             stats.transport)

    def _block_bytes(self) -> int:
        caches = self.loop.engine.runner.kv_caches
        return sum(c[:, 0].numel() * c.element_size() for c in caches)

    def _send_shared(self, plan: ShipPlan) -> TransferStats:
        target = plan.target
        if plan.stream is not None and plan.stream.pieces is None:
            return self.streams.complete(plan.stream, plan.request.block_ids)
        return self.shared.send(target.worker_id, target.export_address,
                                plan.request.request_id, self.loop.engine.runner.kv_buffer.tensor,
                                plan.blocks, target.block_ids, target.transfer_secret)

    def _release(self, engine: LLMEngine, request: Request) -> None:
        self.shipping.pop(request.request_id, None)
        self.cancelled.discard(request.request_id)
        engine.release(request)

    def _result(self, first: RequestOutput, stats: TransferStats | None) -> PrefillResult:
        return PrefillResult(
            first_token=first.new_token_ids[0],
            logprobs=first.logprobs[0] if first.logprobs else None,
            finish_reason=first.finish_reason if first.finished else None,
            stop_reason=first.stop_reason if first.finished else None,
            cached_tokens=first.num_cached_tokens,
            queue_s=first.queue_s or 0.0,
            prefill_s=(first.ttft_s or 0.0) - (first.queue_s or 0.0),
            transfer=stats)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or computing request (its blocks are freed); a request waiting to ship
        is not sent; one whose KV is being sent finishes and is freed after the ack."""

        def run(engine: LLMEngine) -> bool:
            if engine.abort(request_id) is not None:
                self.loop.deliver(RuntimeError(f"request {request_id} aborted"), request_id)
                return True
            if request_id in self.shipping:
                self.cancelled.add(request_id)
                return True
            return False

        return self.loop.call(run, COMMAND_TIMEOUT_S)

    def in_flight(self) -> int:
        """Requests queued, computing or shipping here (drain waits for 0)."""
        return self.loop.call(lambda e: self.loop.num_in_flight() + len(self.shipping),
                              COMMAND_TIMEOUT_S)

    def close(self) -> None:
        self.loop.stop()
        self.shared.close()
        self._executor.shutdown(wait=False, cancel_futures=True)

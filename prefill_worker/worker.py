"""The prefill worker's policy over the shared engine loop: queue prompts, and when a request's
first token is sampled, detach it (keeping its blocks), ship its KV to the decode worker, and free
the blocks only after the decode worker acknowledges."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from engine.engine import LLMEngine, RequestOutput
from engine.request import Request, SamplingParams
from kv_transfer import KVSender, TransferStats
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class DecodeTarget:
    worker_id: str
    address: str  # gRPC
    transfer_address: str  # KV rendezvous store
    block_ids: list[int]


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprobs: dict[int, float] | None
    finish_reason: str | None  # set when the first token ends the request (nothing shipped)
    stop_reason: int | str | None
    cached_tokens: int
    prefill_s: float
    transfer: TransferStats | None


# Starts the decode side's receive (the ReceiveKV RPC) and returns a wait for its acknowledgement.
StartReceive = Callable[[DecodeTarget, str, int, int, int, str], Callable[[float], object]]


class PrefillWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions, start_receive: StartReceive):
        self.options = options
        self.worker_id = options.worker_id
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        self.loop = EngineLoop(engine, observer=self.metrics)
        self.sender = KVSender(options.worker_id, options.host, torch.device(options.device),
                               options.transfer_timeout_s)
        self.start_receive = start_receive
        self.shipping: dict[str, Request] = {}
        self.cancelled: set[str] = set()  # shipping requests aborted before their send began
        # Sends to one decode worker run one at a time; the threads let sends to the others
        # proceed meanwhile (a dead receiver fails fast, so none is held for long).
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send")

    def prefill(self, request_id: str, token_ids: list[int], params: SamplingParams,
                target: DecodeTarget, timeout_s: float) -> PrefillResult:
        """Compute the prompt, sample the first token and ship the KV (ValueError on bad input,
        TimeoutError past `timeout_s`, TransferError when shipping fails)."""
        done: Future[PrefillResult] = Future()

        def queue(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, params, request_id)
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            needed = engine.block_manager.blocks_needed(len(token_ids))
            if len(target.block_ids) != needed:
                raise ValueError(f"decode_block_ids has {len(target.block_ids)} blocks; the "
                                 f"prompt needs {needed}")
            self.loop.sinks[request_id] = lambda item: self._on_first(item, target, done)
            engine.scheduler.add(request)

        self.loop.call(queue, COMMAND_TIMEOUT_S)
        try:
            return done.result(timeout=timeout_s)
        except TimeoutError:
            self.abort(request_id)
            raise

    def _on_first(self, item: RequestOutput | BaseException, target: DecodeTarget,
                  done: Future[PrefillResult]) -> None:
        """Runs on the loop thread when the request's first token is sampled (or it failed)."""
        if isinstance(item, BaseException):
            done.set_exception(item)
            return
        engine = self.loop.engine
        if item.finished:  # nothing to decode: the blocks are already freed
            done.set_result(self._result(item, None))
            return
        self.loop.sinks.pop(item.request_id, None)
        request = engine.detach(item.request_id)
        self.shipping[request.request_id] = request
        self._executor.submit(self._ship, request, item, target, done)

    def _ship(self, request: Request, first: RequestOutput, target: DecodeTarget,
              done: Future[PrefillResult]) -> None:
        engine = self.loop.engine
        blocks = request.block_ids[:len(target.block_ids)]
        dtype = str(engine.dtype).removeprefix("torch.")
        acks: list[Callable[[float], object]] = []
        try:
            if request.request_id in self.cancelled:
                raise RuntimeError(f"request {request.request_id} aborted before its KV was sent")
            stats = self.sender.send(
                target.worker_id, target.transfer_address, engine.runner.kv_caches, blocks,
                lambda generation, tag: acks.append(self.start_receive(
                    target, request.request_id, generation, tag, len(blocks), dtype)))
            acks[0](self.options.transfer_timeout_s)  # the decode side has written the KV
            self.metrics.transfer("sent", stats.num_bytes, stats.seconds)
            done.set_result(self._result(first, stats))
        except Exception as exc:
            self.metrics.transfer_failed("sent")
            log.warning("shipping KV of %s to %s failed: %s", request.request_id,
                        target.worker_id, exc)
            done.set_exception(exc)
        finally:
            self.loop.post(lambda e: self._release(e, request))

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
            prefill_s=first.ttft_s or 0.0,
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
        self._executor.shutdown(wait=False, cancel_futures=True)

"""The prefill worker's policy over the shared engine loop: queue prompts, and when a request's
first token is sampled, detach it (keeping its blocks), ship its KV to the decode worker through
the connector of the transport the router chose, and free the blocks only after the decode worker
acknowledges."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

from engine.engine import LLMEngine, RequestOutput
from engine.omp_threads import use_one_torch_thread
from engine.request import Request, SamplingParams
from kv_transfer import KVSend, KVSendConnector, Transfer, TransferDescriptor, TransferStats
from prefill_worker.handoff import PrefillResult
from prefill_worker.streaming import KVStreams
from serving.gate import Gate, check_queue
from serving.loop import EngineLoop
from serving.metrics import WorkerMetrics
from serving.options import WorkerOptions
from serving.worker_params import worker_params

log = logging.getLogger(__name__)
COMMAND_TIMEOUT_S = 30.0


class PrefillWorker:
    def __init__(self, engine: LLMEngine, options: WorkerOptions,
                 connectors: Mapping[str, KVSendConnector]):
        self.options = options
        self.worker_id = options.worker_id
        self.metrics = WorkerMetrics(options.role, lambda: self.loop.load,
                                     options.tensor_parallel_size)
        self.gate = Gate(options.worker_id, self.metrics, options.max_queued_requests)
        # Sends to one decode worker run one at a time; the threads let sends to the others
        # proceed meanwhile (a dead receiver fails fast, so none is held for long).
        self._executor = ThreadPoolExecutor(max_workers=8, thread_name_prefix="kv-send",
                                            initializer=use_one_torch_thread)
        self.connectors = dict(connectors)  # by transport name
        self.dtype = str(engine.dtype).removeprefix("torch.")
        self.shipping: dict[str, Request] = {}
        self.cancelled: set[str] = set()  # shipping requests aborted before their send began
        self.streams = KVStreams(self.metrics.streamed)
        self.loop = EngineLoop(engine, policy=self.streams, observer=self.metrics)

    def transfer(self, request_id: str, transport: str, descriptor: TransferDescriptor,
                 secret: str) -> Transfer:
        """The request's transfer (ValueError when this worker cannot send by `transport` or
        the decode worker offers no endpoint for it)."""
        if transport not in self.connectors:
            allowed = ", ".join(sorted(self.connectors))
            raise ValueError(f"kv_transport {transport!r} is not one this worker sends KV over "
                             f"(its --kv-transport allows: {allowed})")
        descriptor.endpoint(transport)
        return Transfer(request_id, transport, descriptor, secret, self.dtype)

    def prefill(self, token_ids: list[int], params: SamplingParams, transfer: Transfer,
                timeout_s: float) -> PrefillResult:
        """Compute the prompt, sample the first token and ship the KV (ValueError on bad input,
        TimeoutError past `timeout_s`, TransferError when shipping fails)."""
        request_id, descriptor = transfer.request_id, transfer.descriptor
        self.loop.engine.prepare_constraint(params)  # here, not on the step loop's thread
        done: Future[PrefillResult] = Future()

        def queue(engine: LLMEngine) -> None:
            request = engine.new_request(token_ids, worker_params(params), request_id)
            if request_id in self.shipping or request_id in self.loop.sinks:
                raise ValueError(f"request_id {request_id!r} is already in use")
            check_queue(engine.scheduler.num_waiting, self.gate.max_queued_requests)
            _check_blocks(engine.block_manager.blocks_needed(len(token_ids)), descriptor)
            # Checked before the transfer begins: a refusal leaves no transfer open.
            send = self.connectors[transfer.transport].begin(transfer) \
                if self.options.kv_streaming else None
            self.loop.sinks[request_id] = lambda item: self._on_first(request_id, item,
                                                                      transfer, done)
            engine.scheduler.add(request)
            if send is not None:
                self.streams.open(request_id, send, descriptor.num_cached_blocks,
                                  transfer.num_blocks)

        self.loop.call(queue, COMMAND_TIMEOUT_S)
        try:
            return done.result(timeout=timeout_s)
        except TimeoutError:
            self.abort(request_id)
            raise

    def _on_first(self, request_id: str, item: RequestOutput | BaseException,
                  transfer: Transfer, done: Future[PrefillResult]) -> None:
        """Runs on the loop thread when the request's first token is sampled (or it failed)."""
        if isinstance(item, BaseException) or item.finished:
            self.streams.cancel(request_id)
        if isinstance(item, BaseException):
            done.set_exception(item)
            return
        if item.finished:  # nothing to decode: the blocks are already freed
            done.set_result(self._result(item, None))
            return
        self.loop.sinks.pop(request_id, None)
        send = self.streams.take(request_id)
        request = self.loop.engine.detach(request_id)
        self.shipping[request_id] = request
        self._executor.submit(self._ship, request, item, transfer, done, send)

    def _ship(self, request: Request, first: RequestOutput, transfer: Transfer,
              done: Future[PrefillResult], send: KVSend | None) -> None:
        skip = transfer.descriptor.num_cached_blocks
        blocks = request.block_ids[skip:skip + transfer.num_blocks]
        try:
            if request.request_id in self.cancelled:
                if send is not None:
                    send.abort()
                raise RuntimeError(f"request {request.request_id} aborted before its KV was sent")
            started = time.perf_counter()
            if send is None:
                send = self.connectors[transfer.transport].begin(transfer)
            sent = send.finish(blocks)
            # The whole hand-over counts (control calls, packing, the wait for the decode side's
            # acknowledgement), not only the bytes' flight: it is what the request waits for.
            stats = TransferStats(sent.num_bytes, time.perf_counter() - started, sent.transport)
            self.metrics.transfer("sent", stats.num_bytes, stats.seconds, stats.transport)
            done.set_result(self._result(first, stats))
        except Exception as exc:
            self.metrics.transfer_failed("sent", transfer.transport)
            log.warning("shipping KV of %s to %s failed: %s", request.request_id,
                        transfer.descriptor.receiver_id, exc)
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
            queue_s=first.queue_s or 0.0,
            prefill_s=(first.ttft_s or 0.0) - (first.queue_s or 0.0),
            transfer=stats, prompt_token_ids=first.prompt_token_ids,
            prompt_logprobs=first.prompt_logprobs)

    def abort(self, request_id: str) -> bool:
        """Drop a queued or computing request (its blocks are freed); a request waiting to ship
        is not sent; one whose KV is being sent finishes and is freed after the ack."""

        return self.loop.call(lambda e: self._abort_on_loop(e, request_id), COMMAND_TIMEOUT_S)

    def abort_later(self, request_id: str) -> None:
        """Abort without waiting (safe from gRPC callbacks)."""
        self.loop.post(lambda e: self._abort_on_loop(e, request_id))

    def _abort_on_loop(self, engine: LLMEngine, request_id: str) -> bool:
        if engine.abort(request_id) is not None:
            self.loop.deliver(RuntimeError(f"request {request_id} aborted"), request_id)
            return True
        if request_id in self.shipping:
            self.cancelled.add(request_id)
            return True
        return False

    def in_flight(self) -> int:
        """Requests queued, computing or shipping here (drain waits for 0)."""
        return self.loop.call(lambda e: self.loop.num_in_flight() + len(self.shipping),
                              COMMAND_TIMEOUT_S)

    def close(self) -> None:
        self.loop.stop()
        for connector in self.connectors.values():
            connector.close()
        self._executor.shutdown(wait=False, cancel_futures=True)


def _check_blocks(needed: int, descriptor: TransferDescriptor) -> None:
    """The descriptor's blocks fit the prompt: its cached prefix, then one block per block
    after it (the last is always sent)."""
    cached = descriptor.num_cached_blocks
    if not 0 <= cached < needed:
        raise ValueError(f"transfer.num_cached_blocks is {cached}; the prompt has {needed} "
                         f"blocks and the last is always sent")
    if len(descriptor.block_ids) != needed - cached:
        raise ValueError(f"transfer.block_ids has {len(descriptor.block_ids)} blocks; the prompt "
                         f"needs {needed - cached} after {cached} the decode worker holds")

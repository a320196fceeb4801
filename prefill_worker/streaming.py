"""KV streaming: a long prompt's blocks go to the decode worker chunk by chunk while the next
chunks compute, so its first token waits only for the last chunk's blocks.

Shared transport: each streamed request opens its write on the decode worker when it is queued (on
a sender thread; the loop never waits for it). After every engine step, on the loop thread, the
blocks its prompt has filled since are copied into the reserved blocks — the source blocks cannot
be freed or reused while a step is not running, and a copy returns only once complete. When the
first token is sampled the stream is handed to the shipping thread, which copies what is left (the
last, partial block at least) and finishes the write; on any other end (abort, failure, a first
token that ends the request) the write is finished as failed, so the decode worker frees the
blocks. A request preempted here recomputes its prompt: blocks already copied stay copied (their KV
depends only on the tokens) and copying resumes past them.

dist transport: after every step the newly filled blocks are packed (copied out, on the loop
thread) and sent as a piece (ReceiveKVRequest.first_block / more) by the request's PieceSender;
the shipping thread waits for those, then sends the rest as the last piece. Between pieces the
decode worker's reservation is only reserved, under its lease: nothing to finish on an abort."""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

import torch

from engine.engine import LLMEngine, RequestOutput
from kv_transfer import SharedSender, SharedWrite, TransferError, TransferStats, pack_blocks
from prefill_worker.pieces import PieceSender

log = logging.getLogger(__name__)


@dataclass
class KVStream:
    request_id: str
    receiver_id: str
    src_offset: int  # our prompt's first block to send (the decode worker caches those before)
    dst_ids: list[int]  # the decode worker's reserved blocks, in prompt order
    opened: Future[SharedWrite | None] = field(default_factory=Future)  # None: dist
    sent: int = 0  # blocks of dst_ids copied (shared) or handed to `pieces` (dist) so far
    error: TransferError | None = None  # a copy failed: the tail finishes the write as failed
    pieces: PieceSender | None = None  # dist: its pieces' sender
    secret: str = ""  # the reservation's transfer secret


class KVStreams:
    """The prefill worker's open streams (a StepPolicy of its engine loop)."""

    def __init__(self, sender: SharedSender, executor: Executor,
                 cache: Callable[[], torch.Tensor], timeout_s: float,
                 on_streamed: Callable[[int], None]):
        self.sender = sender
        self.on_streamed = on_streamed  # bytes copied while the prompt was computing
        self.executor = executor
        self.cache = cache  # our whole KV cache (engine.runner.kv_buffer.tensor)
        self.timeout_s = timeout_s
        self.streams: dict[str, KVStream] = {}  # loop thread only

    def open_dist(self, stream: KVStream, pieces: PieceSender) -> None:
        """Stream a request just queued in dist pieces (loop thread)."""
        stream.pieces = pieces
        stream.opened.set_result(None)
        self.streams[stream.request_id] = stream

    def open(self, stream: KVStream, address: str) -> None:
        """Start the shared write for a request just queued (loop thread)."""
        self.streams[stream.request_id] = stream

        def begin() -> None:
            try:
                write = self.sender.begin(stream.receiver_id, address, stream.request_id,
                                          self.cache(), len(stream.dst_ids), stream.secret)
            except BaseException as exc:  # the tail or the cancel reports it
                stream.opened.set_exception(exc)
                return
            stream.opened.set_result(write)

        self.executor.submit(begin)

    def before_step(self, engine: LLMEngine) -> None:
        pass

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Copy the blocks each streamed prompt has filled (loop thread)."""
        for stream in self.streams.values():
            request = engine.scheduler.requests.get(stream.request_id)
            if request is None or stream.error is not None or not stream.opened.done() \
                    or stream.opened.exception() is not None:
                continue
            full = min(request.num_computed_tokens, request.num_prompt_tokens) \
                // engine.block_manager.block_size
            upto = min(full - stream.src_offset, len(stream.dst_ids))
            if upto <= stream.sent:
                continue
            src = request.block_ids[stream.src_offset + stream.sent:stream.src_offset + upto]
            if stream.pieces is not None:
                layers = pack_blocks(engine.runner.kv_caches, src)
                stream.pieces.put(layers, stream.sent, upto - stream.sent)
                self.on_streamed(sum(t.numel() * t.element_size() for t in layers))
                stream.sent = upto
            elif self._copy(stream, src, upto):
                stream.sent = upto

    def _copy(self, stream: KVStream, src: list[int], upto: int) -> bool:
        write = stream.opened.result()
        before = write.num_bytes
        try:  # never waits on the decode worker: a busy mapping is tried next step
            if not write.copy(self.cache(), src, stream.dst_ids[stream.sent:upto], wait=False):
                return False
        except TransferError as exc:
            stream.error = exc
            return False
        self.on_streamed(write.num_bytes - before)
        return True

    def take(self, request_id: str) -> KVStream | None:
        """The request's stream, no longer copied after steps (loop thread)."""
        return self.streams.pop(request_id, None)

    def cancel(self, request_id: str) -> None:
        """The request ended without shipping: its write, once open, is finished as failed, so
        the decode worker frees the blocks (loop thread)."""
        stream = self.take(request_id)
        if stream is not None:
            self.abandon(stream)

    def abandon(self, stream: KVStream) -> None:
        """A taken stream will not be completed: finish its write as failed once open (dist:
        drop its unsent pieces)."""
        if stream.pieces is not None:
            stream.pieces.close(cancel=True)
            return

        def finish(opened: Future[SharedWrite]) -> None:
            if opened.exception() is None:  # never opened: nothing to finish
                self.executor.submit(self._finish_failed, opened.result())

        stream.opened.add_done_callback(finish)

    @staticmethod
    def _finish_failed(write: SharedWrite) -> None:
        try:
            write.finish(ok=False)
        except TransferError as exc:  # the mapping is gone: the decode side ended it already
            log.debug("closing the KV write of %s: %s", write.request_id, exc)

    def complete(self, stream: KVStream, block_ids: list[int]) -> TransferStats:
        """Copy the rest of the prompt's blocks and finish the write (a shipping thread;
        TransferError when the write could not be opened or a copy failed)."""
        try:
            write = stream.opened.result(timeout=self.timeout_s)
        except TimeoutError as exc:
            self.abandon(stream)  # should it open after all
            raise TransferError(f"{stream.receiver_id} did not admit the write of "
                                f"{stream.request_id} in {self.timeout_s:.0f}s") from exc
        if stream.error is not None:
            write.finish(ok=False)
            raise stream.error
        src = block_ids[stream.src_offset + stream.sent:stream.src_offset + len(stream.dst_ids)]
        return self.sender.complete(write, self.cache(), src, stream.dst_ids[stream.sent:])

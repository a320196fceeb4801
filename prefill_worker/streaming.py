"""KV streaming: a long prompt's blocks go to the decode worker chunk by chunk while the next
chunks compute, so its first token waits only for the last chunk's blocks.

A streamed request's transfer is opened (`KVSendConnector.begin`) when the request is queued.
After every engine step, on the loop thread, the blocks its prompt has filled since are handed to
the transfer (`KVSend.send_ready`): the source blocks cannot be freed or reused while no step
runs, and the connector never waits on the decode worker there. When the first token is sampled
the transfer is taken over by the shipping thread, which finishes it; on any other end (abort,
failure, a first token that ends the request) it is aborted, so the decode worker frees the
blocks. A request preempted here recomputes its prompt: blocks already sent stay sent (their KV
depends only on the tokens) and sending resumes past them."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from engine.engine import LLMEngine, RequestOutput
from kv_transfer import KVSend, TransferError, TransferStats

log = logging.getLogger(__name__)


@dataclass
class KVStream:
    send: KVSend
    src_offset: int  # our prompt's first block to send (the decode worker caches those before)
    num_blocks: int  # blocks the transfer carries


class KVStreams:
    """The prefill worker's open streams (a StepPolicy of its engine loop; loop thread only)."""

    def __init__(self, on_streamed: Callable[[int], None]):
        self.on_streamed = on_streamed  # bytes sent while the prompt was computing
        self.streams: dict[str, KVStream] = {}

    def open(self, request_id: str, send: KVSend, src_offset: int, num_blocks: int) -> None:
        self.streams[request_id] = KVStream(send, src_offset, num_blocks)

    def before_step(self, engine: LLMEngine) -> None:
        pass

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        """Hand each streamed prompt's newly filled blocks to its transfer."""
        for request_id, stream in self.streams.items():
            request = engine.scheduler.requests.get(request_id)
            if request is None:
                continue
            full = min(request.num_computed_tokens, request.num_prompt_tokens) \
                // engine.block_manager.block_size
            upto = min(full - stream.src_offset, stream.num_blocks)
            if upto > 0:
                begin = stream.src_offset
                self._send_ready(request_id, stream, request.block_ids[begin:begin + upto])

    def _send_ready(self, request_id: str, stream: KVStream, block_ids: Sequence[int]) -> None:
        # A piece that cannot be sent (its packed copy not allocated, say) fails this transfer
        # alone: raised here, it would end the engine loop's thread and every request with it.
        try:
            self.on_streamed(stream.send.send_ready(block_ids))
        except Exception as exc:
            log.exception("streaming the KV of %s failed", request_id)
            stream.send = FailedSend(stream.send, exc)

    def take(self, request_id: str) -> KVSend | None:
        """The request's transfer, no longer fed after steps."""
        stream = self.streams.pop(request_id, None)
        return None if stream is None else stream.send

    def cancel(self, request_id: str) -> None:
        """The request ended without shipping: its transfer is aborted."""
        send = self.take(request_id)
        if send is not None:
            send.abort()


class FailedSend(KVSend):
    """A streamed transfer whose piece failed: nothing more is sent, and `finish` fails as any
    failed transfer does (the decode worker frees its blocks, the router retries)."""

    def __init__(self, send: KVSend, error: Exception):
        self.send = send
        self.error = error

    def send_ready(self, src_block_ids: Sequence[int]) -> int:
        return 0

    def finish(self, src_block_ids: Sequence[int]) -> TransferStats:
        self.send.abort()
        raise TransferError(f"streaming the KV failed: {self.error}")

    def abort(self) -> None:
        self.send.abort()

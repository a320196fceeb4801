"""Token-budget scheduler with chunked prefill and preemption by recompute. Plain Python, no torch.

Each step assigns a number of tokens to each request under `max_num_batched_tokens` and
`max_num_seqs`: running requests first (decodes and unfinished prefill chunks), then chunks of
waiting prompts fill what is left. Prefill chunks, prefix-cache hits and KV that arrives from
another worker are all jumps of `num_computed_tokens`.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import FinishReason, Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # num_computed_tokens when scheduled: the first position computed this step
    num_tokens: int
    # Whether this step reaches the request's last token, so its logits give a new token.
    samples: bool

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @classmethod
    def of(cls, request: Request, num_tokens: int) -> ScheduledRequest:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class RequestUpdate:
    """What one step changed for one request (the engine turns these into outputs)."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    finished: bool


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager):
        self.config = config
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # ---- requests in and out -------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_running(self, request: Request) -> None:
        """Admit a request whose blocks are allocated and whose KV is already computed (it arrived
        from a prefill worker): it decodes from the next step on."""
        if request.request_id in self.requests:
            raise ValueError(f"request_id {request.request_id!r} is already in use")
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def detach(self, request_id: str) -> Request:
        """Take a running request out of scheduling but keep its blocks: a prefill worker ships
        its KV and frees the blocks (`block_manager.free`) once the receiver acknowledges."""
        request = self.requests.pop(request_id)
        if request.status is not RequestStatus.RUNNING:
            self.requests[request_id] = request
            raise RuntimeError(f"request {request_id} is {request.status.value}, not running")
        self.running.remove(request)
        request.status = RequestStatus.DETACHED
        return request

    def abort(self, request_id: str) -> Request | None:
        """Finish a request wherever it is and free its blocks. Unknown ids are ignored."""
        request = self.requests.get(request_id)
        if request is None:
            return None
        self.finish(request, FinishReason.ABORT)
        return request

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    # ---- schedule ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _chunk(self, remaining: int, budget: int) -> int:
        return min(remaining, budget, self.config.chunk_limit)

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            if num <= 0:
                index += 1
                continue
            while not self.block_manager.allocate_slots(request, num):
                victim = self.running[-1]  # the newest request gives way
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is request:
                    return budget
            out.scheduled.append(ScheduledRequest.of(request, num))
            budget -= num
            index += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        bm = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits = bm.find_cached_prefix(request) if not request.block_ids else []
            num_hit = len(hits) * bm.block_size
            num = self._chunk(request.num_tokens - request.num_computed_tokens - num_hit, budget)
            if not bm.allocate_slots(request, num, hits):
                break
            if request.num_preemptions == 0:
                bm.record_prefix_lookup(request.num_prompt_tokens, num_hit)
                request.num_cached_tokens = num_hit
            request.num_computed_tokens += num_hit
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, num))
            budget -= num

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: drop the KV, keep the tokens, go to the front of the queue."""
        self.running.remove(request)
        self.block_manager.free(request)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    # ---- update --------------------------------------------------------------------------
    def update(
        self,
        out: SchedulerOutput,
        sampled: Sequence[int | None],
        logprobs: Sequence[dict[int, float] | None] | None = None,
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by its step; `sampled[i]` is the token drawn for
        `out.scheduled[i]` (None where that step did not reach the last token). Finished requests
        free their blocks here, in the same step."""
        updates: list[RequestUpdate] = []
        for i, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:  # aborted between schedule and update
                continue
            request.num_computed_tokens = item.end
            self.block_manager.cache_full_blocks(request)
            token = sampled[i]
            if token is None:
                continue
            text = request.append_token(token, logprobs[i] if logprobs else None)
            stop = request.check_stop(text)
            if stop:
                self.finish(request, request.finish_reason or FinishReason.STOP)
            updates.append(RequestUpdate(request, [token], text, stop))
        return updates

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        self.requests.pop(request.request_id, None)

    def all_requests(self) -> Iterable[Request]:
        return self.requests.values()

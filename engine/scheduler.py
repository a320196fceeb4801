"""Token-budget scheduler with chunked prefill and preemption by recompute. Plain Python, no torch.

Each step assigns a number of tokens to each request under `max_num_batched_tokens` and
`max_num_seqs`: running requests first (decodes and unfinished prefill chunks), then chunks of
waiting prompts fill what is left. Prefill chunks, prefix-cache hits and KV that arrives from
another worker are all jumps of `num_computed_tokens`. The order requests are served in is
engine.queue_order's (`SchedulerConfig.queue_policy`); a waiting prompt whose prefix a running
request is still computing waits for those blocks to be cached (engine.prefix_wait)."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.forks import ForkSources
from engine.prefix_wait import PrefixesInFlight
from engine.queue_order import running_order, waiting_order
from engine.request import FinishReason, Request, RequestStatus

# Prompts whose logprobs are asked for get at most this many positions a step, all of them
# together: each is a row of fp32 logits over the vocabulary (512 x 152k x 4 bytes = 311 MB for a
# Qwen-sized vocabulary).
PROMPT_LOGPROBS_CHUNK = 512


class ScheduledRequest(NamedTuple):
    """A request's share of a step (a tuple: a step makes hundreds, and a frozen dataclass
    costs four times as much to build)."""

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
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 clock: Callable[[], float] = time.monotonic, release_window: int | None = None):
        """`release_window`: a model whose every layer slides (the widest window): running
        requests let go of the blocks every window has passed (`_release_passed`)."""
        self.config = config
        self.release_window = release_window
        # The one clock for request ages and finish times: Request.arrival_time is time.monotonic
        # by default, and tests pass their own clock (and arrival times) to control ages.
        self.clock = clock
        self.block_manager = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Async scheduling: the requests of the step still running on the device. One that
        # finishes meanwhile keeps its blocks until that step is done (`release_held`): the
        # step may still write its KV, and freed blocks could go to a peer's write at once.
        self.in_flight: set[str] = set()
        self._held: list[Request] = []
        self._logprob_rows_left = PROMPT_LOGPROBS_CHUNK  # this step's (PROMPT_LOGPROBS_CHUNK)
        self.forks = ForkSources(block_manager, clock)  # prompts held for samples that fork

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

    def add_forked(self, fork: Request, source_id: str) -> list[tuple[int, int]] | None:
        """Admit `fork` (a sample of the same prompt) on the prompt KV of `source_id`
        (engine.forks): it runs from the next step on, computing only its prompt's last position.
        Returns the block copies to make first; None (nothing changed) when it cannot fork."""
        if fork.request_id in self.requests:
            raise ValueError(f"request_id {fork.request_id!r} is already in use")
        copies = self.forks.take(source_id, fork)
        if copies is None:
            return None
        fork.forked = True
        fork.status = RequestStatus.RUNNING
        self.requests[fork.request_id] = fork
        self.running.append(fork)
        return copies

    def block_holders(self) -> list[Request]:
        """Everything that holds blocks: live requests, finished ones a step in flight still
        holds, and fork sources (what BlockManager.check_integrity counts)."""
        return list(self.requests.values()) + self._held + self.forks.holders()

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

    def pause(self, request_id: str) -> str | None:
        """Take a decoding request out of the running batch to move it (with its KV) to another
        worker; None when paused, else why it cannot move now. It stays among the requests
        (an abort or the step in flight still reach it) until `take_paused` detaches it."""
        request = self.requests.get(request_id)
        if request is None or request.status is RequestStatus.PAUSED:
            return "not running here"
        reason = _unmovable(request)
        if reason is not None:
            return reason
        self.running.remove(request)
        request.status = RequestStatus.PAUSED
        return None

    def take_paused(self) -> list[Request]:
        """The paused requests no step in flight still computes, detached: their KV is whole
        (every position before their last token) and nothing writes their blocks any more."""
        settled = [r for r in self.requests.values() if r.status is RequestStatus.PAUSED
                   and r.request_id not in self.in_flight and not r.num_pending]
        for request in settled:
            del self.requests[request.request_id]
            request.status = RequestStatus.DETACHED
        return settled

    def resume(self, request: Request) -> None:
        """A detached request whose move did not happen decodes here again."""
        self.add_running(request)

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
        self._logprob_rows_left = PROMPT_LOGPROBS_CHUNK
        if self.forks:
            self.forks.expire()
        now = self.clock()
        first, later = running_order(self.running, self.waiting, self.config, now)
        budget = self._schedule_running(out, first, self.config.max_num_batched_tokens)
        if not out.preempted:
            budget = self._schedule_waiting(out, budget, now)
        if later and not out.preempted:  # prefills a waiting prompt outranks: what is left
            self._schedule_running(out, later, budget)
        return out

    def _chunk(self, request: Request, remaining: int, budget: int) -> int:
        num = min(remaining, budget, self.config.chunk_limit)
        if request.params.prompt_logprobs is not None and remaining > 1:  # its positions have
            num = min(num, self._logprob_rows_left)  # logits: the step's share (a decode has 1)
            self._logprob_rows_left -= num
        return num

    def _schedule_running(self, out: SchedulerOutput, requests: list[Request],
                          budget: int) -> int:
        for request in requests:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted earlier in this pass
                continue
            num = self._chunk(request, request.num_tokens - request.num_computed_tokens, budget)
            if num <= 0:
                continue
            fits, refund = self._make_room(out, request, num)
            budget += refund
            if not fits:
                break
            out.scheduled.append(ScheduledRequest.of(request, num))
            budget -= num
        return budget

    def _make_room(self, out: SchedulerOutput, request: Request, num: int) -> tuple[bool, int]:
        """Preempt the newest running requests until `request` gets `num` slots. Returns whether
        it did (False: it was the newest and gave way itself) and the budget given back by
        victims already scheduled this step (possible only when short_first reorders the pass)."""
        refund = 0
        while not self.block_manager.allocate_slots(request, num):
            if self.forks.release_reclaimable():  # held prompts give way before requests
                continue
            victim = self.running[-1]  # the newest request gives way
            self._preempt(victim)
            out.preempted.append(victim)
            refund += self._unschedule(out, victim)
            if victim is request:
                return False, refund
        return True, refund

    @staticmethod
    def _unschedule(out: SchedulerOutput, request: Request) -> int:
        for i, item in enumerate(out.scheduled):
            if item.request is request:
                del out.scheduled[i]
                return item.num_tokens
        return 0

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, now: float) -> int:
        """Admit waiting requests into what is left of the budget; returns what is left then."""
        if not self.waiting or budget <= 0 or len(self.running) >= self.config.max_num_seqs:
            return budget  # before ordering: short_first sorts the whole queue
        bm = self.block_manager
        admitted = 0
        in_flight = PrefixesInFlight(bm, self.running)
        for request in waiting_order(self.waiting, self.config, now):
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            # A prompt whose logprobs are asked for computes every position: cached ones have
            # no logits (vLLM skips the cache for them too).
            cacheable = not request.block_ids and request.params.prompt_logprobs is None
            hits = bm.find_cached_prefix(request) if cacheable else []
            if cacheable and in_flight.should_wait(request, len(hits)):
                continue  # a running request is computing its prefix: it waits for the cache
            num_hit = len(hits) * bm.block_size
            num = self._chunk(request, request.num_tokens - request.num_computed_tokens - num_hit,
                              budget)
            # Head of line: never skip past a request that does not fit (or, asking for prompt
            # logprobs, finds the step's share of them spent), so big ones cannot starve by
            # being passed over forever.
            if num <= 0 or not self._allocate_waiting(request, num, hits):
                break
            if request.num_preemptions == 0:
                bm.record_prefix_lookup(request.num_prompt_tokens, num_hit)
                request.num_cached_tokens = num_hit
            request.num_computed_tokens += num_hit
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(ScheduledRequest.of(request, num))
            budget -= num
            admitted += 1
        if admitted:
            self._drop_admitted()
        return budget

    def _allocate_waiting(self, request: Request, num: int, hits: list[int]) -> bool:
        """Blocks for a waiting request's chunk, giving up held prompts (engine.forks) if that is
        what it takes."""
        bm = self.block_manager
        while not bm.allocate_slots(request, num, hits):
            needed = bm.blocks_needed(request.num_computed_tokens + len(hits) * bm.block_size
                                      + num) - len(request.block_ids) - len(hits)
            if needed > bm.num_allocatable(hits) + self.forks.reclaimable():  # could not help
                return False
            self.forks.release_reclaimable()
        return True

    def _drop_admitted(self) -> None:  # in place: callers may hold `scheduler.waiting`
        kept = [r for r in self.waiting if r.status is RequestStatus.WAITING]
        self.waiting.clear()
        self.waiting.extend(kept)

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
    def mark_launched(self, out: SchedulerOutput) -> None:
        """Async scheduling: the step runs on the device, so the next one is scheduled now as if
        it were done — its positions computed, its sampled tokens pending."""
        for item in out.scheduled:
            item.request.num_computed_tokens = item.end
            item.request.num_pending += item.samples
        self.in_flight = {item.request.request_id for item in out.scheduled}

    @property
    def held_requests(self) -> list[Request]:
        """Finished requests whose blocks a step in flight still holds."""
        return list(self._held)

    def release_held(self) -> None:
        """Free the blocks of finished requests that no step in flight still holds."""
        held, self._held = self._held, []
        for request in held:
            self._free(request)

    def update(
        self,
        out: SchedulerOutput,
        sampled: Sequence[int | None],
        logprobs: Sequence[dict[int, float] | None] | None = None,
        computed_at_launch: bool = False,
        prompt_logprobs: Sequence[list[dict[int, float]] | None] | None = None,
    ) -> list[RequestUpdate]:
        """Advance each scheduled request by its step; `sampled[i]` is the token drawn for
        `out.scheduled[i]` (None where that step did not reach the last token), and
        `prompt_logprobs[i]` the logprobs of the prompt tokens after its chunk's positions (where
        asked for). Finished requests free their blocks here, in the same step. With
        `computed_at_launch` (async scheduling), `mark_launched` already advanced the positions,
        possibly past this step's."""
        updates: list[RequestUpdate] = []
        for i, item in enumerate(out.scheduled):
            request = item.request
            if request.is_finished:  # aborted between schedule and update
                continue
            if prompt_logprobs and prompt_logprobs[i]:
                _record_prompt_logprobs(request, item.start, prompt_logprobs[i])
            if not computed_at_launch:
                request.num_computed_tokens = item.end
            token = sampled[i]
            if token is not None:
                text = request.append_token(token, logprobs[i] if logprobs else None)
                if request.forks_expected:  # its prompt is computed: its samples fork from it
                    self.forks.hold(request)
            # After the append: under async scheduling the computed positions may already
            # include this token's (the next step is running), and block keys need its id.
            self.block_manager.cache_full_blocks(request)
            if token is None:
                continue
            stop = request.check_stop(text)
            if stop:
                self.finish(request, request.finish_reason or FinishReason.STOP)
            elif self.release_window is not None and self.config.release_passed_blocks \
                    and request.status is RequestStatus.RUNNING:  # a paused one moves whole
                self._release_passed(request, self.release_window)
            updates.append(RequestUpdate(request, [token], text, stop))
        return updates

    def _release_passed(self, request: Request, window: int) -> None:
        """A decoding request's blocks wholly before every future query's window go back to the
        pool. Under async scheduling the next step (up to a step's budget of this request's
        positions) may already run: its queries see keys from its first position - window + 1
        on, so the margin is the step budget. A prompt its samples fork from is held apart
        (engine.forks took its own references when the prompt was computed, before this)."""
        if request.num_computed_tokens < request.num_prompt_tokens:
            return
        bm = self.block_manager
        first_needed = request.num_computed_tokens - self.config.max_num_batched_tokens \
            - window + 1
        if first_needed > 0:
            bm.release_before(request, first_needed // bm.block_size)

    def finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        if request.request_id in self.in_flight:
            self._held.append(request)
        else:
            self._free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        request.finished_time = self.clock()
        self.requests.pop(request.request_id, None)

    def _free(self, request: Request) -> None:
        self.block_manager.free(request)
        request.num_pending = 0

    def all_requests(self) -> Iterable[Request]:
        return self.requests.values()


def _unmovable(request: Request) -> str | None:
    """Why a running request's KV cannot move to another worker now (None: it can)."""
    if request.status is not RequestStatus.RUNNING \
            or request.num_computed_tokens < request.num_prompt_tokens \
            or not request.output_token_ids:
        return "its prompt is still being computed"
    if request.num_computed_tokens < request.num_known_tokens - 1:
        # preempted earlier, it is recomputing its prompt and output: its KV is not whole yet
        return "its KV is still being recomputed after a preemption"
    if request.params.structured_output is not None:
        return "its output is constrained (structured_output): the constraint cannot move"
    if request.num_released_blocks:
        return "its sliding windows released blocks already"
    return None


def _record_prompt_logprobs(request: Request, start: int,
                            entries: list[dict[int, float]]) -> None:
    """Row `start + j` of a chunk gives prompt token `start + j + 1`'s logprobs. A prompt
    recomputed after preemption writes the same positions again."""
    if not request.prompt_logprobs:
        request.prompt_logprobs = [None] * request.num_prompt_tokens
    request.prompt_logprobs[start + 1:start + 1 + len(entries)] = entries

"""LLMEngine: validation at the door, then the one step loop (schedule → execute → update)."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig, ModelConfig, default_dtype
from engine.loader import resolve_model_path
from engine.model_runner import LaunchedStep, ModelRunner
from engine.request import FinishReason, OutputKind, Request, SamplingParams
from engine.scheduler import RequestUpdate, Scheduler, SchedulerOutput
from engine.tokenizer import Tokenizer
from engine.tp_ranks import RankLauncher

log = logging.getLogger(__name__)


@dataclass
class RequestOutput:
    """A request's state after a step: the delta of this step plus everything so far."""

    request_id: str
    prompt_token_ids: list[int]
    new_token_ids: list[int]
    new_text: str
    # Everything so far, or (params.output_kind DELTA) the same as the delta: new_token_ids,
    # new_text and the delta's logprobs
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[dict[int, float]] | None = None
    # params.prompt_logprobs set: per prompt position, its token's logprobs given the tokens
    # before it (None at position 0); the request's own list, complete from the first token on
    prompt_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0
    forked: bool = False  # computed none of its prompt: it forked from a sample's (engine.forks)
    ttft_s: float | None = None  # arrival → first token
    latency_s: float | None = None  # arrival → finish
    queue_s: float | None = None  # arrival → its first step (the rest of ttft_s is compute)
    # Output tokens so far, whatever the kind (None when built: len(token_ids))
    num_output_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.num_output_tokens is None:
            self.num_output_tokens = len(self.token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 rank_launcher: RankLauncher | None = None):
        """`rank_launcher`: where tensor-parallel ranks 1.. run (default: local processes)."""
        config = config or EngineConfig()
        self.config = config
        self.model_path = resolve_model_path(config.model)
        self.model_config = ModelConfig.from_dir(self.model_path)
        self.tokenizer = Tokenizer(self.model_path)
        self.dtype = config.dtype or default_dtype(config.device)
        self.max_model_len = self._max_model_len()
        self.runner = ModelRunner(config, self.model_config, self.model_path, self.dtype,
                                  self.max_model_len, rank_launcher)
        cache = config.cache
        self.block_manager = BlockManager(self.runner.num_blocks, cache.block_size,
                                          cache.enable_prefix_caching)
        sched = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched, self.block_manager,
                                   release_window=self.model_config.release_window)
        self.eos_token_ids = self.tokenizer.end_token_ids(self.model_config.eos_token_ids)
        self._ids = itertools.count()
        self._in_flight: tuple[SchedulerOutput, LaunchedStep] | None = None  # async scheduling

    def _max_model_len(self) -> int:
        limits = [self.model_config.max_position_embeddings]
        if self.config.max_model_len is not None:
            limits.append(self.config.max_model_len)
        return min(limits)

    # ---- requests ------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        """Validate and queue a request; ValueError (engine unchanged) on bad input."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        request = self.new_request(self.tokenize(prompt), params, request_id)
        self.scheduler.add(request)
        return request_id

    def new_request(self, token_ids: list[int], params: SamplingParams,
                    request_id: str) -> Request:
        """A validated request that is not queued yet (ValueError on bad input)."""
        self.validate(token_ids, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, token_ids, params, eos_token_ids=self.eos_token_ids,
                          max_model_len=self.max_model_len)
        if params.detokenize:
            request.text_stream = self.tokenizer.text_stream(token_ids,
                                                             params.skip_special_tokens)
        if params.stop and params.continued_tokens:
            request.stop_context = self._continued_text(token_ids, params)
        return request

    def _continued_text(self, token_ids: list[int], params: SamplingParams) -> str:
        """The end of the text of the output a request continues (the prompt's last
        continued_tokens, detokenized as that request did): a stop string may begin in it
        and end in this request's output."""
        split = len(token_ids) - params.continued_tokens
        stream = self.tokenizer.text_stream(token_ids[:split], params.skip_special_tokens)
        text = "".join(stream.step(t) for t in token_ids[split:])
        return text[len(text) - max(len(s) for s in params.stop) + 1:]

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return self.tokenizer.encode(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a str or a list of token ids, got {type(prompt)}")
        return [int(t) for t in prompt]

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        """Check a tokenized prompt and its parameters against this engine's limits."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.model_config.vocab_size
        if not token_ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        if params.continued_tokens >= len(token_ids):
            raise ValueError(f"continued_tokens ({params.continued_tokens}) must be less than the "
                             f"prompt's {len(token_ids)} tokens")
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids contains {bad}, outside the vocabulary [0, {vocab})"
            )
        bad = next((t for t in params.stop_token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"stop_token_ids contains {bad}, outside the vocabulary [0, {vocab})")
        bad = next((t for t, _ in params.logit_bias if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"logit_bias contains {bad}, outside the vocabulary [0, {vocab})")
        if params.structured_output is not None:
            self.runner.grammars.compile(params.structured_output)  # ValueError: why not
        total = len(token_ids) + params.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} "
                f"exceeds max_model_len {self.max_model_len}"
            )
        bm = self.block_manager
        if bm.blocks_needed(total) > bm.num_blocks:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens}) needs "
                f"{bm.blocks_needed(total)} KV blocks but the whole KV cache holds {bm.num_blocks} "
                f"({bm.num_blocks * bm.block_size} tokens)"
            )

    def abort(self, request_id: str) -> RequestOutput | None:
        request = self.scheduler.abort(request_id)
        self.runner.grammars.drop(request_id)
        return None if request is None else self._output(request, [])

    # ---- disaggregated prefill/decode -----------------------------------------------------
    def reserve(self, request: Request) -> bool:
        """Allocate blocks for the prompt's KV; False (nothing allocated) when they do not fit.
        The prompt's longest prefix already in this prefix cache is shared, not reserved afresh:
        its blocks come first in `block_ids` (`request.num_cached_tokens` of them by tokens) and
        a transfer writes only the fresh blocks after them."""
        bm = self.block_manager
        hits = bm.find_cached_prefix(request)
        num_hit = len(hits) * bm.block_size
        while not bm.allocate_slots(request, request.num_prompt_tokens - num_hit, hits):
            if not self.scheduler.forks.release_reclaimable():  # held prompts give way first
                return False
        bm.record_prefix_lookup(request.num_prompt_tokens, num_hit)
        request.num_cached_tokens = num_hit
        return True

    def admit_prefilled(self, request: Request, first_token: int,
                        logprobs: dict[int, float] | None = None) -> RequestOutput:
        """The prompt's KV sits in the reserved blocks and the prefill worker sampled the first
        token: the request decodes from the next step on (or finishes here)."""
        request.num_computed_tokens = request.num_prompt_tokens
        self.block_manager.cache_full_blocks(request)
        text = request.append_token(first_token, logprobs)
        self.scheduler.forks.hold(request)  # for the samples that fork from it, if any
        self.scheduler.add_running(request)
        if request.check_stop(text):
            self.scheduler.finish(request, request.finish_reason)
        return self._output(request, [first_token])

    def fork(self, request: Request, source_id: str) -> bool:
        """Admit `request`, a sample of the prompt of `source_id`, on that prompt's KV (shared
        blocks, the last one copied: engine.forks); False (nothing changed) when it cannot
        fork, and the caller adds it as a request of its own."""
        copies = self.scheduler.add_forked(request, source_id)
        if copies is None:
            return False
        try:
            self.runner.copy_blocks(copies)
        except Exception:  # no copy, no fork: it must not run on a block it never got
            self.scheduler.finish(request, FinishReason.ABORT)
            raise
        finally:
            self.scheduler.forks.release_spent()
        return True

    def expire_held(self) -> None:
        """Release the held prompts (engine.forks) whose lease ended, also while idle."""
        self.scheduler.forks.expire()

    def detach(self, request_id: str) -> Request:
        """Stop scheduling a request but keep its blocks (its KV is being shipped)."""
        request = self.scheduler.detach(request_id)
        self.runner.grammars.drop(request_id)  # the decode side rebuilds it from the output
        return request

    # ---- moving a running request to another worker --------------------------------------
    def pause(self, request_id: str) -> str | None:
        """Stop decoding a request to move it (None), or why it cannot move now."""
        return self.scheduler.pause(request_id)

    def take_paused(self) -> list[Request]:
        """Paused requests whose KV is settled, detached (their blocks still held)."""
        return self.scheduler.take_paused()

    def resume(self, request: Request) -> None:
        """A paused request that did not move decodes here again from the next step."""
        self.scheduler.resume(request)

    def release(self, request: Request) -> None:
        """Free the blocks of a request that is not in the scheduler (reserved or detached)."""
        self.block_manager.free(request)

    def bind_thread(self) -> None:
        """Before the first step on a thread other than the one that built the engine."""
        self.runner.bind_thread()

    def broken(self) -> str | None:
        """Why this engine can never step again (a tensor-parallel rank is gone), or None: its
        host should go down as a unit."""
        return self.runner.broken()

    def close(self) -> None:
        """Release what outlives a step: the other tensor-parallel ranks' processes."""
        self.runner.close()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._in_flight is not None

    # ---- the step loop -------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        counts = self.runner.token_counts
        if len(counts) > len(self.scheduler.requests):  # some left: their rows are free again
            counts.retain(self.scheduler.requests)
        if self.config.async_scheduling:
            # A constrained request's mask needs its previous token on the host: while one
            # runs, steps are synchronous (the step in flight is finished first).
            if not self._has_constrained():
                return self._step_async()
            if self._in_flight is not None:
                return self._step_async(launch=False)
        out = self.scheduler.schedule()
        if out.is_empty:
            return []
        _note_first_scheduled(out)
        result = self.runner.execute(out)
        updates = self.scheduler.update(out, result.sampled, result.logprobs,
                                        prompt_logprobs=result.prompt_logprobs)
        return self._outputs(updates)

    def _has_constrained(self) -> bool:
        return any(r.params.structured_output for r in self.scheduler.all_requests())

    def _step_async(self, launch: bool = True) -> list[RequestOutput]:
        """Async scheduling: schedule and launch step N+1 as if step N were done, then read step
        N and apply it, so the host's scheduling and batch preparation run while the device
        computes. A request that step N finishes loses step N+1's row (and keeps its blocks
        until that step is done); outputs are those of `step`, each one call later."""
        previous, self._in_flight = self._in_flight, None
        try:
            out = self.scheduler.schedule() if launch else SchedulerOutput()
            if not out.is_empty:
                _note_first_scheduled(out)
                self._in_flight = (out, self.runner.launch(out, previous and previous[1]))
            self.scheduler.mark_launched(out)  # an empty step: nothing is in flight any more
            if previous is None:
                return []
            result = self.runner.collect(previous[1])
        except Exception:  # the caller fails the requests: none may keep blocks held, and none
            self.runner.wait_idle()  # may be freed while steps launched before still run
            self._in_flight = None
            self.scheduler.mark_launched(SchedulerOutput())
            self.scheduler.release_held()
            raise
        self.scheduler.release_held()  # step N is done: nothing writes their blocks any more
        updates = self.scheduler.update(previous[0], result.sampled, result.logprobs,
                                        computed_at_launch=True,
                                        prompt_logprobs=result.prompt_logprobs)
        return self._outputs(updates)

    def _outputs(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """The step's outputs: one per update, but none for a FINAL_ONLY request still running."""
        outputs = []
        for update in updates:
            request = update.request
            if request.params.structured_output is not None:
                self._check_constraint(request, update.new_token_ids[-1])
            if request.params.output_kind is not OutputKind.FINAL_ONLY or request.is_finished:
                outputs.append(self._output(request, update.new_token_ids))
        return outputs

    def _check_constraint(self, request: Request, token: int) -> None:
        if not self.runner.grammars.accept(request, token) and not request.is_finished:
            log.warning("request %s: token %d breaks its %s constraint; it ends here",
                        request.request_id, token, request.params.structured_output.kind)
            self.scheduler.finish(request, FinishReason.ABORT)

    def prepare_constraint(self, params: SamplingParams) -> None:
        """Compile a request's output constraint now (ValueError: why it cannot be): callable
        from any thread, so the step loop finds it compiled rather than compiling it while
        every running request waits."""
        if params.structured_output is not None:
            self.runner.grammars.compile(params.structured_output)

    def _output(self, request: Request, new_ids: list[int]) -> RequestOutput:
        params = request.params
        new_text = request.take_visible_text()
        num_output = len(request.output_token_ids)
        if params.output_kind is OutputKind.DELTA:  # nothing so far copied again
            token_ids, text = new_ids, new_text
            logprobs = request.output_logprobs[num_output - len(new_ids):] \
                if params.logprobs is not None else None
        else:
            token_ids, text = list(request.output_token_ids), request.output_text
            logprobs = list(request.output_logprobs) if params.logprobs is not None else None
            if params.output_kind is OutputKind.FINAL_ONLY and request.is_finished:
                new_ids, new_text = token_ids, text  # its one output: all of it is new
        now = time.monotonic()
        first = request.first_token_time
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            new_token_ids=new_ids,
            new_text=new_text,
            token_ids=token_ids,
            text=text,
            finished=request.is_finished,
            finish_reason=request.finish_reason.value if request.finish_reason else None,
            stop_reason=request.stop_reason,
            logprobs=logprobs,
            prompt_logprobs=(request.prompt_logprobs or [None] * request.num_prompt_tokens)
            if request.params.prompt_logprobs is not None else None,
            num_cached_tokens=request.num_cached_tokens,
            forked=request.forked,
            ttft_s=None if first is None else first - request.arrival_time,
            latency_s=now - request.arrival_time if request.is_finished else None,
            queue_s=None if request.first_scheduled_time is None
            else request.first_scheduled_time - request.arrival_time,
            num_output_tokens=num_output,
        )


def _note_first_scheduled(out: SchedulerOutput) -> None:
    now = time.monotonic()
    for scheduled in out.scheduled:
        if scheduled.request.first_scheduled_time is None:
            scheduled.request.first_scheduled_time = now

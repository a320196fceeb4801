"""Requests and sampling parameters: plain Python, no torch."""

from __future__ import annotations

import enum
import functools
import json
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on a request's output, enforced each step by masking every token that would
    break it (engine.structured_output, with xgrammar): `json_schema` (`spec`: the schema as
    JSON text), `json_object` (any JSON object), `regex` (`spec`: the pattern) or `choice`
    (`spec`: a JSON list of the allowed strings). The output ends when the constraint is
    complete (only EOS is then allowed)."""

    kind: str
    spec: str = ""

    KINDS = ("json_schema", "json_object", "regex", "choice")

    def __post_init__(self) -> None:
        if self.kind not in self.KINDS:
            raise ValueError(f"structured_output kind must be one of {', '.join(self.KINDS)}, "
                             f"got {self.kind!r}")
        if self.kind == "json_object":
            return
        if not self.spec:
            raise ValueError(f"structured_output {self.kind} needs its {self.kind}")
        if self.kind in ("json_schema", "choice"):
            try:
                value = json.loads(self.spec)
            except json.JSONDecodeError as exc:
                raise ValueError(f"structured_output {self.kind} is not valid JSON: {exc}") \
                    from None
            if self.kind == "json_schema" and not isinstance(value, (dict, bool)):
                raise ValueError("structured_output json_schema must be a JSON object")
            if self.kind == "choice" and not (isinstance(value, list) and value and all(
                    isinstance(c, str) and c for c in value)):
                raise ValueError("structured_output choice must be a non-empty list of "
                                 "non-empty strings")


class OutputKind(str, enum.Enum):
    """Which outputs a request's steps produce (vLLM's RequestOutputKind).

    CUMULATIVE: every step's output, with everything so far (`token_ids`, `text`, `logprobs`)
    beside the step's delta. DELTA: every step's output with only the delta, so a long output's
    tokens are not copied again at every step (what a streaming server reads). FINAL_ONLY: one
    output, as the request ends, whose delta is the whole output (what batch generation reads):
    a step builds none for the requests still running."""

    CUMULATIVE = "cumulative"
    DELTA = "delta"
    FINAL_ONLY = "final_only"


GREEDY_BELOW_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling, validated on construction (ValueError names the field and its limit).

    temperature 0 (below 1e-5, as vLLM) means greedy. top_k -1 disables top-k; top_p 1.0
    disables nucleus sampling.
    `logprobs`: None for none, 0 for the sampled token's logprob, k for that plus the top k.

    Logit processing, as vLLM defines it (applied in engine.logits_processing, in this order):
    `logit_bias` adds (token id, bias) pairs to the logits; before `min_tokens` output tokens
    exist, EOS and `stop_token_ids` are masked and no stop condition ends the request;
    `repetition_penalty` divides positive (multiplies negative) logits of tokens seen in the
    prompt or the output; `frequency_penalty` subtracts itself times a token's count in the
    output, `presence_penalty` itself once for every token present in the output.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_tokens: int = 0
    # None: none; k: each prompt token's logprob given the tokens before it, plus the top k
    # (computed by the worker that computes the prompt; such a prompt skips the prefix cache,
    # whose positions have no logits)
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    # The prompt's last `continued_tokens` are the output of a request this one continues (the
    # router's migration): the frequency and presence penalties count them as output, and a
    # seeded request draws at their positions' offset, so the continuation samples as the
    # request it continues would have. max_tokens and min_tokens are what is left.
    continued_tokens: int = 0
    # How the engine hands the request's outputs over, and whether it builds their text (False:
    # `text` stays empty and no stop string can be asked for, as in vLLM). Never on the wire:
    # each worker picks what its own consumer reads (serving.worker_params).
    output_kind: OutputKind = OutputKind.CUMULATIVE
    detokenize: bool = True

    MAX_LOGPROBS = 20
    MAX_PENALTY = 2.0  # presence and frequency: OpenAI's bound, both signs
    MAX_REPETITION_PENALTY = 2.0
    MAX_LOGIT_BIAS = 100.0  # OpenAI's bound, both signs

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        _check_int("max_tokens", self.max_tokens)
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        temp = float(self.temperature)
        if math.isnan(temp) or temp < 0 or math.isinf(temp):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        top_p = float(self.top_p)
        if math.isnan(top_p) or not (0.0 < top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        for name, value in (("temperature", temp), ("top_p", top_p)):
            object.__setattr__(self, name, value)  # the sampler reads floats, not "0.5"
        _check_int("top_k", self.top_k)
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not (0 <= self.seed < 2**64):
                raise ValueError(f"seed must be in [0, 2**64), got {self.seed}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value)
                if not (0 <= value <= self.MAX_LOGPROBS):
                    raise ValueError(f"{name} must be in [0, {self.MAX_LOGPROBS}], got {value}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop strings must be non-empty str, got {s!r}")
        self._check_logit_processing()
        self._check_output()

    def _check_output(self) -> None:
        try:
            object.__setattr__(self, "output_kind", OutputKind(self.output_kind))
        except ValueError:
            raise ValueError(f"output_kind must be one of "
                             f"{', '.join(k.value for k in OutputKind)}, got "
                             f"{self.output_kind!r}") from None
        for name in ("detokenize", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (they are found in the text)")

    def _check_logit_processing(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = float(getattr(self, name))
            if not -self.MAX_PENALTY <= value <= self.MAX_PENALTY:  # NaN fails too
                raise ValueError(f"{name} must be in [-{self.MAX_PENALTY:g}, "
                                 f"{self.MAX_PENALTY:g}], got {getattr(self, name)}")
        if not 0.0 < float(self.repetition_penalty) <= self.MAX_REPETITION_PENALTY:
            raise ValueError(f"repetition_penalty must be in (0, {self.MAX_REPETITION_PENALTY:g}]"
                             f", got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        bias = dict(self.logit_bias)  # accepts a mapping or pairs; one entry per token
        for token, value in bias.items():
            _check_int("logit_bias token id", token)
            if token < 0:
                raise ValueError(f"logit_bias token ids must be >= 0, got {token}")
            if not -self.MAX_LOGIT_BIAS <= float(value) <= self.MAX_LOGIT_BIAS:
                raise ValueError(f"logit_bias[{token}] must be in [-{self.MAX_LOGIT_BIAS:g}, "
                                 f"{self.MAX_LOGIT_BIAS:g}], got {value}")
        object.__setattr__(self, "logit_bias",
                           tuple(sorted((t, float(v)) for t, v in bias.items())))
        _check_int("continued_tokens", self.continued_tokens)
        if self.continued_tokens < 0:
            raise ValueError(f"continued_tokens must be >= 0, got {self.continued_tokens}")
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be in [0, max_tokens={self.max_tokens}], got "
                             f"{self.min_tokens}")
        if self.min_tokens and self.structured_output is not None:
            # A complete constraint allows only EOS, which min_tokens would mask: nothing left.
            raise ValueError("min_tokens cannot be combined with structured_output (the "
                             "constraint decides where the output ends)")

    # Cached (in the instance's __dict__, beside the frozen fields): each step asks them of
    # every sampling row, several times.
    @functools.cached_property
    def greedy(self) -> bool:
        # vLLM's rule: below 1e-5 a temperature is greedy. Dividing by a far smaller one makes
        # the logits infinite and the probabilities NaN (every row then sampled token 0).
        return self.temperature < GREEDY_BELOW_TEMPERATURE

    @functools.cached_property
    def penalizes_history(self) -> bool:
        """Whether sampling needs the tokens seen so far (a penalty is set)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @functools.cached_property
    def processes_logits(self) -> bool:
        """Whether any logit processing is set (bias, min_tokens or a penalty)."""
        return bool(self.logit_bias) or self.min_tokens > 0 or self.penalizes_history


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    DETACHED = "detached"  # out of the scheduler, blocks still held (its KV is being shipped)
    # Out of the running batch, blocks held, waiting for the step in flight (if any) to settle
    # before it is detached to move to another worker (Scheduler.pause)
    PAUSED = "paused"


_FINISHED = RequestStatus.FINISHED


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


def find_stop_string(text: str, new_len: int, stops: Sequence[str], context: str = "",
                     include: bool = False) -> tuple[int, str] | None:
    """The first of `stops` (in their order) that the last `new_len` characters of `text` complete,
    with where `text` then ends: where the stop string starts, or (`include`) where it ends. Only
    those characters and the len(stop) - 1 before them can hold a match not found at an earlier
    token. `context` is the text just before `text` began (a continued request's earlier
    output), searched when a match may start in it. None where no stop string ends there."""
    for stop in stops:
        start = len(text) - new_len - len(stop) + 1
        back = min(-start, len(context)) if start < 0 else 0  # reaching into the context
        index = (context[len(context) - back:] + text if back else text).find(stop, max(0, start))
        if index != -1:
            index -= back
            return max(0, index + len(stop) if include else index), stop
    return None


class TextStream(Protocol):
    """Incremental detokenizer attached to a request (see engine.tokenizer)."""

    def step(self, token_id: int) -> str: ...


@dataclass(eq=False)
class Request:
    """One generation. The scheduler owns its status and num_computed_tokens; only the block
    manager writes `block_ids`. Compared by identity: two requests are never the same one for
    having equal fields, and `running.remove` then costs a pointer comparison per entry, not a
    tuple of every field (at 256 running, a finishing request compared ~128 of them)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_computed_tokens: int = 0
    # Tokens sampled by a step still running on the device, not yet appended (async scheduling:
    # the next step is scheduled before they are read; its inputs take them on the device).
    num_pending: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache on first admission
    # Samples of the same prompt that will fork from this request (engine.forks): its prompt's
    # blocks are held for them once the prompt is computed
    forks_expected: int = 0
    forked: bool = False  # this request forked from another's prompt (it computed none of it)
    # params.prompt_logprobs set: position p's entry is prompt token p's logprobs given the tokens
    # before it (position 0 has none); filled as the prompt's chunks compute
    prompt_logprobs: list[dict[int, float] | None] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    # block_ids[:num_released_blocks] are no longer held (every layer's sliding window has
    # passed them: BlockManager.release_before); their ids stay so positions keep their index
    num_released_blocks: int = 0
    num_preemptions: int = 0
    first_scheduled_time: float | None = None  # its first step began (the end of its queueing)
    first_token_time: float | None = None
    finished_time: float | None = None
    text_stream: TextStream | None = None
    output_text: str = ""
    num_emitted_chars: int = 0
    # The last characters of the text before this request's output where it continues another
    # request (params.continued_tokens): a stop string may start there (engine.new_request)
    stop_context: str = ""
    _block_hashes: list[int] = field(default_factory=list)
    # The prefix-cache keys of the prompt's full blocks, once asked for (BlockManager.prompt_keys)
    prompt_block_keys: list[int] | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Every token the request has, the pending ones included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Output tokens sampled so far, the pending ones included (seeds follow this index)."""
        return len(self.output_token_ids) + self.num_pending

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, index: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[index] if index < n else self.output_token_ids[index - n]

    def tokens_in(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n]

    @property
    def is_finished(self) -> bool:
        return self.status is _FINISHED  # asked several times per request per step

    def append_token(self, token_id: int, logprobs: dict[int, float] | None = None) -> str:
        """Record a sampled token (a pending one, if any, first); return the text it completes
        ("" while a character is split)."""
        if self.num_pending:
            self.num_pending -= 1
        if not self.output_token_ids:
            self.first_token_time = time.monotonic()
        self.output_token_ids.append(token_id)
        if logprobs is not None:
            self.output_logprobs.append(logprobs)
        delta = self.text_stream.step(token_id) if self.text_stream is not None else ""
        self.output_text += delta
        return delta

    def take_visible_text(self) -> str:
        """Text not yet handed out. While running, the last len(longest stop) - 1 characters are
        held back, so a stop string is never half-emitted before it is recognised."""
        text = self.output_text
        end = len(text)
        if not self.is_finished and self.params.stop:
            end = max(self.num_emitted_chars, end - max(len(s) for s in self.params.stop) + 1)
        delta = text[self.num_emitted_chars:end]
        self.num_emitted_chars = end
        return delta

    def check_stop(self, new_text: str) -> bool:
        """Set finish_reason if the last token ends the request. Truncates text at a stop string."""
        token = self.output_token_ids[-1]
        p = self.params
        if len(self.output_token_ids) < p.min_tokens:  # no stop before min_tokens (vLLM's rule)
            return self._check_length()
        if (not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids:
            # As vLLM: the token that ends the request is left out of the text (an EOS's
            # "<|im_end|>" with special tokens kept, a stop token id's "\n") unless the stop is
            # asked to stay in the output.
            if new_text and not p.include_stop_str_in_output:
                self.output_text = self.output_text[:-len(new_text)]
            return self._finish_with(FinishReason.STOP, token)
        # A stop string counts once it ends in a token after the min_tokens-th (vLLM's rule).
        if p.stop and new_text and len(self.output_token_ids) > p.min_tokens \
                and self._truncate_at_stop_string(len(new_text)):
            return True
        return self._check_length()

    def _check_length(self) -> bool:
        if (len(self.output_token_ids) >= self.params.max_tokens
                or self.num_known_tokens >= self.max_model_len):
            return self._finish_with(FinishReason.LENGTH, None)
        return False

    def _truncate_at_stop_string(self, new_len: int) -> bool:
        p = self.params
        found = find_stop_string(self.output_text, new_len, p.stop, self.stop_context,
                                 p.include_stop_str_in_output)
        if found is None:
            return False
        end, stop = found
        self.output_text = self.output_text[:end]
        return self._finish_with(FinishReason.STOP, stop)

    def _finish_with(self, reason: FinishReason, stop_reason: int | str | None) -> bool:
        self.finish_reason = reason
        self.stop_reason = stop_reason
        return True

"""What a prefill hands back to the router."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_transfer import TransferStats


@dataclass(frozen=True)
class PrefillResult:
    first_token: int
    logprobs: dict[int, float] | None
    finish_reason: str | None  # set when the first token ends the request (nothing shipped)
    stop_reason: int | str | None
    cached_tokens: int
    queue_s: float  # arrival here -> the prompt's first step
    prefill_s: float  # the prompt's first step -> its first token
    transfer: TransferStats | None
    # sampling.prompt_logprobs set: the prompt and, per position, its token's logprobs
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list[dict[int, float] | None] | None = None

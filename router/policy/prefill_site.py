"""Conditional disaggregation: per request, prefill on a prefill worker (and ship the KV) or on the
chosen decode worker itself. Plain Python over the numbers the router already has.

Disaggregation protects running streams from long prefills, but a short prompt pays for it twice:
it queues behind whatever the prefill pool is computing (documents of thousands of tokens) and its
KV then has to move. A decode worker can take a short prefill in its own steps, in small chunks
(its `--prefill-chunk-size`), at a small cost to its streams' inter-token latency. So a prompt is
prefilled locally when

- *short*: what the decode worker would compute for it (its prompt less the prefix the decode
  worker already caches) fits in one of that worker's prefill chunks, and that plus the local
  prefill work already queued there fits in `max_local_tokens`; or
- *the pool is backed up*: the prefill work ahead of it on the best prefill worker, plus its own,
  exceeds `local_cost_factor` × the same on the decode worker (local prefill runs slower: it
  shares steps with the decodes and takes small chunks).

A prompt of several chunks is not short: the decode worker would spread it over as many steps,
each as long as a decode step plus its chunk, where an idle prefill worker computes it in one
(measured on 2 CPU cores with 32-token chunks: 256-token prompts at 1 req/s reached their first
token after ~610 ms locally and ~290 ms through the idle prefill worker, so the cluster's TTFT
was higher at low load, where such prompts counted as short, than at high load).

Every decision is returned with its inputs (`SiteDecision`), which the router logs and counts.
"""

from __future__ import annotations

from dataclasses import dataclass

SITE_MODES = ("auto", "off")


@dataclass(frozen=True)
class PrefillSiteConfig:
    mode: str = "auto"  # auto: decide per request; off: always on a prefill worker
    max_local_tokens: int = 512
    local_cost_factor: float = 4.0

    def __post_init__(self) -> None:
        if self.mode not in SITE_MODES:
            raise ValueError(f"--local-prefill must be one of {', '.join(SITE_MODES)}, got "
                             f"{self.mode!r}")
        if self.max_local_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got "
                             f"{self.max_local_tokens}")
        if not self.local_cost_factor >= 1:
            raise ValueError(f"local_cost_factor must be >= 1, got {self.local_cost_factor}")


@dataclass(frozen=True)
class SiteInputs:
    prompt_tokens: int
    decode_cached_tokens: int  # of the prompt, already in the decode worker's prefix cache
    decode_queued_tokens: int  # prefill work queued on the decode worker (reported + placed)
    # The least prefill work a prefill worker would do before this prompt's is done (its queue
    # plus the prompt less its cached prefix); None when no prefill worker can take it.
    pool_tokens: int | None
    # The decode worker's prefill chunk (tokens per request per step); 0 when it did not say.
    decode_chunk_tokens: int = 0


@dataclass(frozen=True)
class SiteDecision:
    local: bool
    reason: str  # "short", "pool backed up", "long", "no prefill worker", "off"
    inputs: SiteInputs

    @property
    def site(self) -> str:
        return "local" if self.local else "remote"

    def describe(self) -> str:
        i = self.inputs
        return (f"prefill {self.site} ({self.reason}): prompt {i.prompt_tokens} tokens, "
                f"{i.decode_cached_tokens} cached on the decode worker, "
                f"{i.decode_queued_tokens} queued there, chunks of "
                f"{i.decode_chunk_tokens or 'any size'}, prefill pool "
                f"{'none' if i.pool_tokens is None else i.pool_tokens} tokens to its end")


class PrefillSitePolicy:
    def __init__(self, config: PrefillSiteConfig | None = None):
        self.config = config or PrefillSiteConfig()

    def decide(self, inputs: SiteInputs) -> SiteDecision:
        if self.config.mode == "off":
            return SiteDecision(False, "off", inputs)
        if inputs.pool_tokens is None:
            return SiteDecision(True, "no prefill worker", inputs)
        local_tokens = self.local_tokens(inputs)
        local_work = inputs.decode_queued_tokens + local_tokens
        one_step = not inputs.decode_chunk_tokens or local_tokens <= inputs.decode_chunk_tokens
        if one_step and local_work <= self.config.max_local_tokens:
            return SiteDecision(True, "short", inputs)
        if self.config.local_cost_factor * local_work < inputs.pool_tokens:
            return SiteDecision(True, "pool backed up", inputs)
        return SiteDecision(False, "long", inputs)

    @staticmethod
    def local_tokens(inputs: SiteInputs) -> int:
        """What the decode worker would compute for the prompt (at least its last token)."""
        return max(1, inputs.prompt_tokens - inputs.decode_cached_tokens)

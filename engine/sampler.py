"""Batched sampling: logit processing (engine.logits_processing: bias, min_tokens, penalties),
greedy, temperature, top-k, top-p, per-request seeds, logprobs (of the unprocessed logits).

Random rows use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1)), which draws
exactly from p. A seeded request draws E from its own generator, seeded by (seed, output index), so
its output does not depend on the batch it runs in, on preemption, or on which worker samples it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_tensors import to_device
from engine.logits_processing import RowHistory, process_logits
from engine.request import SamplingParams
from engine.row_argmax import row_argmax
from engine.structured_output import apply_bitmask
from engine.token_counts import TokenCounts

_MASK64 = (1 << 63) - 1


def seed_for_step(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


@dataclass
class SamplingBatch:
    """The sampling parameters of the rows that sample this step, in row order."""

    params: list[SamplingParams]
    output_indices: list[int]  # how many tokens each request has produced so far
    # Per row, what logit processing needs (None where the row asks for none); absent: no row
    # processes logits.
    histories: list[RowHistory | None] | None = None
    pending_tokens: torch.Tensor | None = None  # the device tokens RowHistory.pending_row indexes
    token_counts: TokenCounts | None = None  # the histories kept on the device (penalties)
    # Structured output: the token bitmask and the constrained rows (engine.structured_output)
    bitmask: tuple[torch.Tensor, list[int]] | None = None

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)

    @property
    def argmax_only(self) -> bool:
        """Every row's token is its logits' argmax, with nothing else read from them."""
        return self.bitmask is None and all(
            p.greedy and p.logprobs is None and not p.processes_logits for p in self.params)


@dataclass
class DeviceSamples:
    """A step's sampled tokens still on the device: `tokens` [n] int64 (a later step may read
    them on the device), and what the host reads once — the tokens, or the packed tokens and
    logprobs — copied towards pinned host memory without waiting (CUDA), with an event to wait
    on."""

    tokens: torch.Tensor
    wanted: list[int | None]
    _host: torch.Tensor
    _ready: torch.cuda.Event | None = None

    def read(self) -> tuple[list[int], list[dict[int, float] | None]]:
        """The step's one host read: waits for this step's sampling only, not later work."""
        if self._ready is not None:
            self._ready.synchronize()
        if all(w is None for w in self.wanted):
            return self._host.tolist(), [None] * len(self.wanted)
        return _unpack(self._host, len(self.wanted), self.wanted)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """`logits` [n, vocab] float32 → one token per row and, where asked, its logprobs.
        Everything is computed on the logits' device; the host reads it once."""
        return self.sample(logits, batch).read()

    def sample(self, logits: torch.Tensor, batch: SamplingBatch) -> DeviceSamples:
        """Sample on the device and start the copy the host will read; nothing waits here.
        `logits` may be in the model's dtype: a batch that only picks greedy tokens reads them
        as they are (widening to float32 is exact and keeps the order); any other widens them
        first."""
        if logits.dtype != torch.float32 and not batch.argmax_only:
            logits = logits.float()
        processed = logits
        if batch.histories is not None:
            processed = process_logits(logits, batch.params, batch.output_indices,
                                       batch.histories, batch.pending_tokens, batch.token_counts)
        if batch.bitmask is not None:
            processed = processed.clone() if processed is logits else processed
            apply_bitmask(processed, batch.bitmask)
        greedy_tokens = row_argmax(processed)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            tokens = self._sample_random(processed, batch, greedy_tokens)
        wanted = [p.logprobs for p in batch.params]
        packed = tokens if all(w is None for w in wanted) else \
            _with_logprobs(logits, tokens, wanted)
        if packed.device.type != "cuda":
            return DeviceSamples(tokens, wanted, packed)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        host.copy_(packed, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(packed.device))
        return DeviceSamples(tokens, wanted, host, ready)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch,
                       greedy_tokens: torch.Tensor) -> torch.Tensor:
        device = logits.device
        params = batch.params
        temps = to_device([p.temperature if not p.greedy else 1.0 for p in params],
                          torch.float32, device)
        x = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            x = _apply_top_k_top_p(x, params)
        probs = torch.softmax(x, dim=-1)
        # One draw for every row (one kernel, not one per row: at 256 rows on a GPU those
        # launches outlast a graphed decode step), then the seeded rows' own draws over theirs.
        noise = torch.empty_like(probs).exponential_()
        for row, p in enumerate(params):
            if p.seed is not None:
                gen = torch.Generator(device=device)
                # a continuation (after a migration) draws where the request it continues was
                gen.manual_seed(seed_for_step(p.seed,
                                              batch.output_indices[row] + p.continued_tokens))
                noise[row].exponential_(generator=gen)
        sampled = row_argmax(probs / noise)
        greedy = to_device([p.greedy for p in params], torch.bool, device)
        return torch.where(greedy, greedy_tokens, sampled)


def _with_logprobs(logits: torch.Tensor, tokens: torch.Tensor, wanted: list[int | None]
                   ) -> torch.Tensor:
    """One float64 vector on the device: the tokens, their logprobs, then (if any row asks for
    alternatives) the top ids and their logprobs, row by row — read by the host in one go.
    Logprobs are the model's own distribution, before temperature and truncation."""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
    parts = [tokens.to(torch.float64), chosen.to(torch.float64)]
    top_n = max(w or 0 for w in wanted)
    if top_n:
        top_values, top_ids = logprobs.topk(top_n, dim=-1)
        parts += [top_ids.to(torch.float64).flatten(), top_values.to(torch.float64).flatten()]
    return torch.cat(parts)


def _unpack(packed: torch.Tensor, n: int, wanted: list[int | None]
            ) -> tuple[list[int], list[dict[int, float] | None]]:
    values = packed.tolist()  # the step's one read of the device
    tokens = [int(t) for t in values[:n]]
    chosen = values[n:2 * n]
    top_n = max(w or 0 for w in wanted)
    top_ids, top_values = values[2 * n:2 * n + n * top_n], values[2 * n + n * top_n:]
    result: list[dict[int, float] | None] = []
    for row, want in enumerate(wanted):
        if want is None:
            result.append(None)
            continue
        entry = {tokens[row]: chosen[row]}
        for k in range(row * top_n, row * top_n + want):
            entry.setdefault(int(top_ids[k]), top_values[k])
        result.append(entry)
    return tokens, result


def _apply_top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = x.shape[-1]
    device = x.device
    top_k = to_device([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64, device)
    top_p = to_device([p.top_p for p in params], torch.float32, device)
    sorted_x, order = x.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device).unsqueeze(0)
    drop = ranks >= top_k.clamp(max=vocab).unsqueeze(1)
    sorted_x = sorted_x.masked_fill(drop, float("-inf"))
    probs = torch.softmax(sorted_x, dim=-1)
    # Drop a token when the tokens ranked above it already reach top_p (the first always stays).
    before = probs.cumsum(dim=-1) - probs
    nucleus = (before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
    sorted_x = sorted_x.masked_fill(nucleus, float("-inf"))
    return torch.full_like(x, float("-inf")).scatter(-1, order, sorted_x)

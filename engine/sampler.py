"""Batched sampling: greedy, temperature, top-k, top-p, per-request seeds, logprobs.

Random rows use the exponential-race form of sampling (argmax of p / E with E ~ Exp(1)), which draws
exactly from p. A seeded request draws E from its own generator, seeded by (seed, output index), so
its output does not depend on the batch it runs in, on preemption, or on which worker samples it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.request import SamplingParams

_MASK64 = (1 << 63) - 1


def seed_for_step(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + output_index * 0xBF58476D1CE4E5B9 + 1) & _MASK64


@dataclass
class SamplingBatch:
    """The sampling parameters of the rows that sample this step, in row order."""

    params: list[SamplingParams]
    output_indices: list[int]  # how many tokens each request has produced so far

    @property
    def all_greedy(self) -> bool:
        return all(p.greedy for p in self.params)


class Sampler:
    def __call__(self, logits: torch.Tensor, batch: SamplingBatch
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """`logits` [n, vocab] float32 → one token per row and, where asked, its logprobs."""
        greedy_tokens = logits.argmax(dim=-1)
        if batch.all_greedy:
            tokens = greedy_tokens
        else:
            tokens = self._sample_random(logits, batch, greedy_tokens)
        token_list = tokens.tolist()
        return token_list, self._logprobs(logits, batch, token_list)

    def _sample_random(self, logits: torch.Tensor, batch: SamplingBatch,
                       greedy_tokens: torch.Tensor) -> torch.Tensor:
        device = logits.device
        params = batch.params
        temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params],
                             device=device, dtype=torch.float32)
        x = logits / temps.unsqueeze(1)
        if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
            x = _apply_top_k_top_p(x, params)
        probs = torch.softmax(x, dim=-1)
        noise = torch.empty_like(probs)
        for row, p in enumerate(params):
            if p.seed is None:
                noise[row].exponential_()
            else:
                gen = torch.Generator(device=device)
                gen.manual_seed(seed_for_step(p.seed, batch.output_indices[row]))
                noise[row].exponential_(generator=gen)
        sampled = (probs / noise).argmax(dim=-1)
        greedy = torch.tensor([p.greedy for p in params], device=device)
        return torch.where(greedy, greedy_tokens, sampled)

    def _logprobs(self, logits: torch.Tensor, batch: SamplingBatch, tokens: list[int]
                  ) -> list[dict[int, float] | None]:
        wanted = [p.logprobs for p in batch.params]
        if all(w is None for w in wanted):
            return [None] * len(tokens)
        # Logprobs of the model's own distribution, before temperature and truncation.
        logprobs = torch.log_softmax(logits, dim=-1)
        top_n = max(w or 0 for w in wanted)
        top_values, top_ids = (logprobs.topk(top_n, dim=-1) if top_n else (None, None))
        chosen = logprobs.gather(1, torch.tensor(tokens, device=logits.device).unsqueeze(1))
        result: list[dict[int, float] | None] = []
        for row, n in enumerate(wanted):
            if n is None:
                result.append(None)
                continue
            entry = {tokens[row]: float(chosen[row, 0])}
            if n and top_ids is not None:
                for tid, val in zip(top_ids[row, :n].tolist(), top_values[row, :n].tolist()):
                    entry.setdefault(tid, val)
            result.append(entry)
        return result


def _apply_top_k_top_p(x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = x.shape[-1]
    device = x.device
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p = torch.tensor([p.top_p for p in params], device=device, dtype=torch.float32)
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

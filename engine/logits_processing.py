"""Per-request logit processing on the logits' device, before sampling: logit_bias, min_tokens
and the repetition, frequency and presence penalties, as vLLM defines and orders them (bias and
min_tokens first, then the penalties; see SamplingParams). Only rows that ask for something are
touched, so a batch without any costs nothing.

What the penalties count — the request's output (with the output of the request it continues,
after a migration: `SamplingParams.continued_tokens`) and, for the repetition penalty, its
prompt — is kept on the device across steps by engine.token_counts, each step adding only its new
tokens; a token a step still on the device sampled is added there. Without that state (the
reference the tests use) the history travels as one padded id matrix and one scatter."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_tensors import to_device
from engine.request import Request, SamplingParams
from engine.token_counts import TokenCounts


@dataclass
class RowHistory:
    """What one sampling row's processing needs beyond its SamplingParams."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]  # the ones the host knows (with continued ones, if any)
    stop_token_ids: tuple[int, ...]  # masked before min_tokens: EOS (unless ignored) and stop ids
    pending_row: int | None = None  # row of a token sampled on the device, not yet on the host
    request: Request | None = None  # whose TokenCounts row holds the history (the two lists
    # above are then not read)


def stop_ids_for_min_tokens(params: SamplingParams, eos_token_ids: tuple[int, ...]
                            ) -> tuple[int, ...]:
    return tuple(dict.fromkeys((() if params.ignore_eos else eos_token_ids)
                               + params.stop_token_ids))


def process_logits(logits: torch.Tensor, params: list[SamplingParams],
                   output_indices: list[int], histories: list[RowHistory | None],
                   pending_tokens: torch.Tensor | None = None,
                   token_counts: TokenCounts | None = None) -> torch.Tensor:
    """`logits` [n, vocab] float32 → the processed logits (a new tensor; `logits` is kept for
    logprobs, which are the model's own distribution). `pending_tokens`: the device tokens that
    RowHistory.pending_row indexes; `token_counts`: the histories' state on the device (rows
    whose RowHistory names its request)."""
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    if not rows:
        return logits
    out = logits.clone()
    _add_bias(out, [(i, params[i]) for i in rows])
    _mask_stops(out, [(i, histories[i]) for i in rows
                      if output_indices[i] < params[i].min_tokens])
    penalized = [i for i in rows if params[i].penalizes_history]
    if penalized:
        _apply_penalties(out, penalized, params, histories, pending_tokens, token_counts)
    return out


def _add_bias(out: torch.Tensor, rows: list[tuple[int, SamplingParams]]) -> None:
    index = [(i, t, b) for i, p in rows for t, b in p.logit_bias]
    if not index:
        return
    device = out.device
    row_ids = to_device([i for i, _, _ in index], torch.int64, device)
    token_ids = to_device([t for _, t, _ in index], torch.int64, device)
    bias = to_device([b for _, _, b in index], torch.float32, device)
    out.index_put_((row_ids, token_ids), bias, accumulate=True)


def _mask_stops(out: torch.Tensor, rows: list[tuple[int, RowHistory | None]]) -> None:
    index = [(i, t) for i, h in rows if h is not None for t in h.stop_token_ids]
    if not index:
        return
    device = out.device
    row_ids = to_device([i for i, _ in index], torch.int64, device)
    token_ids = to_device([t for _, t in index], torch.int64, device)
    # Filled on the device: torch.tensor(value, device=cuda) copies from pageable host memory,
    # which waits for the step already queued (async scheduling's overlap lost).
    out.index_put_((row_ids, token_ids),
                   torch.full((len(index),), float("-inf"), dtype=out.dtype, device=device))


def _apply_penalties(out: torch.Tensor, rows: list[int], params: list[SamplingParams],
                     histories: list[RowHistory | None], pending_tokens: torch.Tensor | None,
                     token_counts: TokenCounts | None) -> None:
    device = out.device
    found = [histories[i] for i in rows]
    if any(h is None for h in found):
        raise ValueError("a penalized sampling row has no token history")
    hist = [h for h in found if h is not None]
    counts, seen_in_prompt = _history_counts(hist, [params[i] for i in rows], out.shape[1],
                                             device, token_counts)
    pending = [(k, h.pending_row) for k, h in enumerate(hist) if h.pending_row is not None]
    if pending:
        if pending_tokens is None:
            raise ValueError("a pending token without the step that sampled it")
        at = to_device([k for k, _ in pending], torch.int64, device)
        src = to_device([r for _, r in pending], torch.int64, device)
        counts.index_put_((at, pending_tokens.index_select(0, src)),
                          torch.ones(len(pending), device=device), accumulate=True)
    select = to_device(rows, torch.int64, device)
    x = out.index_select(0, select)
    rep = _column([params[i].repetition_penalty for i in rows], device)
    seen = seen_in_prompt | (counts > 0)
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - _column([params[i].frequency_penalty for i in rows], device) * counts
    x = x - _column([params[i].presence_penalty for i in rows], device) * (counts > 0)
    out.index_copy_(0, select, x)


def _history_counts(hist: list[RowHistory], params: list[SamplingParams], vocab: int,
                    device: torch.device, token_counts: TokenCounts | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, vocab] counts of each row's output history (a fresh tensor: the caller adds pending
    tokens to it) and [n, vocab] whether a token is in its prompt (repetition penalty only)."""
    wants_prompt = [p.repetition_penalty != 1.0 for p in params]
    requests = [h.request for h in hist]
    if token_counts is not None and all(r is not None for r in requests):
        return token_counts.gather([r for r in requests if r is not None], wants_prompt)
    counts = _counts([h.output_token_ids for h in hist], vocab, device)
    in_prompt = _counts([h.prompt_token_ids if wants else []
                         for h, wants in zip(hist, wants_prompt)], vocab, device) > 0
    return counts, in_prompt


def _counts(token_lists: list[list[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab] float32: how often each row holds each token."""
    width = max((len(t) for t in token_lists), default=0)
    counts = torch.zeros(len(token_lists), vocab + 1, dtype=torch.float32, device=device)
    if width:
        padded = [t + [vocab] * (width - len(t)) for t in token_lists]  # the pad column is cut
        ids = to_device(padded, torch.int64, device)
        counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return to_device(values, torch.float32, device).unsqueeze(1)

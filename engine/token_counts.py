"""What the penalties count, kept on the logits' device across steps: per request, how often each
token occurs in its output and which tokens occur in its prompt. A step adds only the tokens new
since the request's last step (one scatter for the whole batch), so its host work is those
tokens, not the request's whole history again; a long prompt is scattered once.

Each request owns a row of one [rows, vocab] table while it samples with a penalty; rows of
requests that left the engine are reused (`retain`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from engine.device_tensors import to_device
from engine.request import Request


@dataclass
class _Row:
    owner: Request
    counted: int  # tokens of its output history already counted
    prompt_seen: bool  # its prompt's tokens are marked in the seen table


class TokenCounts:
    def __init__(self, vocab: int, device: torch.device):
        self.vocab = vocab
        self.device = device
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self.in_prompt = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self._rows: dict[int, _Row] = {}  # row index -> its request
        self._row_of: dict[str, int] = {}  # request id -> row index
        self._free: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    def gather(self, requests: list[Request], want_prompt: list[bool]
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows of `requests` ([n, vocab] counts of their output history, [n, vocab] whether
        a token is in their prompt — marked only where `want_prompt`), brought up to date with
        their tokens the host knows."""
        rows = [self._row(r) for r in requests]
        count_at: list[int] = []
        count_ids: list[int] = []
        seen_at: list[int] = []
        seen_ids: list[int] = []
        for request, row, prompt in zip(requests, rows, want_prompt):
            state = self._rows[row]
            new = output_history(request, state.counted)
            count_at += [row] * len(new)
            count_ids += new
            state.counted += len(new)
            if prompt and not state.prompt_seen:
                seen_at += [row] * request.num_prompt_tokens
                seen_ids += request.prompt_token_ids
                state.prompt_seen = True
        if count_ids:
            self.counts.index_put_(self._index(count_at, count_ids),
                                   torch.ones(len(count_ids), device=self.device), accumulate=True)
        if seen_ids:
            self.in_prompt.index_put_(self._index(seen_at, seen_ids),  # filled on the device
                                      torch.ones(len(seen_ids), dtype=torch.bool,
                                                 device=self.device))
        select = to_device(rows, torch.int64, self.device)
        return self.counts.index_select(0, select), self.in_prompt.index_select(0, select)

    def retain(self, live: Mapping[str, Request]) -> None:
        """Free the rows of requests no longer in the engine (finished, aborted, detached)."""
        for row, state in list(self._rows.items()):
            if live.get(state.owner.request_id) is not state.owner:
                self._release(row)

    def _row(self, request: Request) -> int:
        row = self._row_of.get(request.request_id)
        if row is not None and self._rows[row].owner is request:
            return row
        if row is not None:  # the id was reused by a new request: the old one is gone
            self._release(row)
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._rows[row] = _Row(request, 0, False)
        self._row_of[request.request_id] = row
        return row

    def _release(self, row: int) -> None:
        state = self._rows.pop(row)
        if self._row_of.get(state.owner.request_id) == row:
            del self._row_of[state.owner.request_id]
        self.counts[row].zero_()
        self.in_prompt[row].zero_()
        self._free.append(row)

    def _grow(self) -> None:
        old = self.counts.shape[0]
        new = max(8, old * 2)
        counts = torch.zeros(new, self.vocab, dtype=torch.float32, device=self.device)
        in_prompt = torch.zeros(new, self.vocab, dtype=torch.bool, device=self.device)
        counts[:old] = self.counts
        in_prompt[:old] = self.in_prompt
        self.counts, self.in_prompt = counts, in_prompt
        self._free.extend(range(new - 1, old - 1, -1))

    def _index(self, rows: list[int], tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        return (to_device(rows, torch.int64, self.device),
                to_device(tokens, torch.int64, self.device))


def output_history(request: Request, start: int = 0) -> list[int]:
    """What the frequency and presence penalties count, from position `start`: the prompt's last
    `params.continued_tokens` (the output of the request this one continues, after a migration)
    and then its own output tokens the host knows."""
    carried = request.params.continued_tokens
    prompt = request.prompt_token_ids
    head = prompt[len(prompt) - carried + start:] if start < carried else []
    return head + request.output_token_ids[max(0, start - carried):]

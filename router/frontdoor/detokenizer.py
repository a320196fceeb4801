"""Incremental detokenization for one stream: never splits a multi-byte character, and holds
back the last len(longest stop string) - 1 characters so a stop string is never half-sent.
Stop strings are found as the engine finds them (engine.request.find_stop_string): in each
token's new text, from the token after the min_tokens-th on, and the token that ends the request
(EOS, a stop token id) is left out of the text, so the text ends where the workers' did."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from engine.request import find_stop_string
from engine.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str],
                 min_tokens: int = 0, skip_special_tokens: bool = True,
                 include_stop: bool = False, stop_token_ids: Collection[int] = ()):
        self._stream = tokenizer.text_stream(list(prompt_ids), skip_special_tokens)
        self._stop = tuple(stop)
        self._stop_token_ids = frozenset(stop_token_ids)  # EOS (unless ignored) and stop ids
        self._min_tokens = min_tokens
        self._include_stop = include_stop
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._tokens = 0
        self.text = ""
        self._sent = 0
        self.stopped_at: str | None = None
        self._ended = False  # at a stop string or a stop token

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that may be sent now."""
        for token_id in token_ids:
            if self._ended:
                break
            piece = self._stream.step(token_id)
            self._tokens += 1
            if token_id in self._stop_token_ids and self._tokens >= self._min_tokens:
                # The token that ends the request: its text stays out, as the workers' and
                # vLLM's, unless the stop is kept.
                self.text += piece if self._include_stop else ""
                self._ended = True
                break
            self.text += piece
            if piece and self._stop and self._tokens > self._min_tokens:
                self._truncate_at_stop(len(piece))
        end = len(self.text) if self._ended else len(self.text) - self._holdback
        return self._take(max(end, self._sent))

    def finish(self) -> str:
        """The stream ended: everything not yet sent (already cut at a stop string)."""
        return self._take(len(self.text))

    def _truncate_at_stop(self, new_len: int) -> None:
        found = find_stop_string(self.text, new_len, self._stop, include=self._include_stop)
        if found is not None:
            end, self.stopped_at = found
            self.text = self.text[:end]
            self._ended = True

    def _take(self, end: int) -> str:
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

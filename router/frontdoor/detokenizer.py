"""Incremental detokenization for one stream: never splits a multi-byte character, and holds
back the last len(longest stop string) - 1 characters so a stop string is never half-sent."""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer


class IncrementalText:
    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], stop: Sequence[str]):
        self._stream = tokenizer.text_stream(list(prompt_ids))
        self._stop = tuple(stop)
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""
        self._sent = 0
        self.stopped_at: str | None = None

    def add(self, token_ids: Sequence[int]) -> str:
        """Feed new tokens; return the text that may be sent now."""
        for token_id in token_ids:
            if self.stopped_at is not None:
                break
            self.text += self._stream.step(token_id)
            self._truncate_at_stop()
        end = len(self.text) if self.stopped_at is not None else len(self.text) - self._holdback
        return self._take(max(end, self._sent))

    def finish(self) -> str:
        """The stream ended: everything not yet sent (already cut at a stop string)."""
        return self._take(len(self.text))

    def _truncate_at_stop(self) -> None:
        for stop in self._stop:
            index = self.text.find(stop, max(0, self._sent - len(stop)))
            if index != -1:
                self.text = self.text[:index]
                self.stopped_at = stop
                return

    def _take(self, end: int) -> str:
        delta = self.text[self._sent:end]
        self._sent = max(self._sent, end)
        return delta

"""Structured output with xgrammar (as vLLM and SGLang use it): each constrained request has a
grammar matcher; before sampling, the rows that sample for such requests get a token bitmask
(every token that would break the constraint masked to -inf), batched with unconstrained rows;
after sampling, each matcher accepts its request's token.

Grammars are compiled once per constraint: xgrammar's compiler caches what it compiled. A
matcher is built from a request's output so far when the request first samples here, so a
request that arrives with tokens (a prefill worker's first token, a preemption, a migration)
continues where its output stands. xgrammar is imported on first use (it takes ~2 s)."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import torch

from engine.request import Request, StructuredOutput

# JSON may hold whitespace between its tokens, at most this much in a row: a weak model cannot
# spend its whole budget on newlines and never close the object.
MAX_WHITESPACE = 20
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarBook:
    """Compiled constraints and the matchers of this engine's constrained requests."""

    def __init__(self, model_dir: Path, vocab_size: int):
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._lock = threading.Lock()  # workers compile on their gRPC handler threads
        self._matchers: dict[str, Any] = {}

    def _xgr(self) -> Any:
        import xgrammar

        with self._lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgrammar.TokenizerInfo.from_huggingface(tokenizer,
                                                               vocab_size=self.vocab_size)
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1)
        return xgrammar

    def compile(self, constraint: StructuredOutput) -> Any:
        """The compiled grammar; ValueError naming what is wrong with the constraint."""
        self._xgr()
        compiler = self._compiler
        try:
            if constraint.kind == "json_object":  # OpenAI's json_object: an object, any keys
                return compiler.compile_json_schema('{"type": "object"}', strict_mode=False,
                                                    max_whitespace_cnt=MAX_WHITESPACE)
            if constraint.kind == "json_schema":
                return compiler.compile_json_schema(constraint.spec, strict_mode=True,
                                                    max_whitespace_cnt=MAX_WHITESPACE)
            if constraint.kind == "regex":
                return compiler.compile_regex(constraint.spec)
            choices = json.loads(constraint.spec)
            return compiler.compile_grammar(_choice_grammar(choices))
        except (RuntimeError, ValueError) as exc:  # xgrammar's: "[time] file.cc:line: why"
            why = _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0])
            raise ValueError(f"structured_output {constraint.kind} cannot be compiled: {why}") \
                from None

    def matcher(self, request: Request) -> Any:
        found = self._matchers.get(request.request_id)
        if found is None:
            xgr = self._xgr()
            found = xgr.GrammarMatcher(self.compile(request.params.structured_output))
            for token in request.output_token_ids:  # what it produced elsewhere or before
                found.accept_token(token)
            self._matchers[request.request_id] = found
        return found

    def bitmask(self, rows: list[Request | None], device: torch.device
                ) -> tuple[torch.Tensor, list[int]] | None:
        """The token bitmask of the rows ([rows, words] int32, on `device`; the constrained
        rows filled) and the constrained rows' indices; None when no row is constrained."""
        constrained = [(i, r) for i, r in enumerate(rows) if r is not None]
        if not constrained:
            return None
        xgr = self._xgr()
        mask = xgr.allocate_token_bitmask(len(rows), self.vocab_size)
        for i, request in constrained:
            self.matcher(request).fill_next_token_bitmask(mask, i)
        return mask.to(device, non_blocking=True), [i for i, _ in constrained]

    def accept(self, request: Request, token: int) -> bool:
        """The request's new token (False: it breaks the constraint, which a mask that left
        nothing allowed can cause); a finished request's matcher is dropped."""
        matcher = self.matcher(request)
        accepted = matcher.is_terminated() or matcher.accept_token(token)
        if request.is_finished or not accepted:
            self.drop(request.request_id)
        return accepted

    def drop(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)


def apply_bitmask(logits: torch.Tensor, mask: tuple[torch.Tensor, list[int]]) -> None:
    """Mask, in place, every token the rows' constraints forbid."""
    import xgrammar

    bitmask, indices = mask
    xgrammar.apply_token_bitmask_inplace(logits, bitmask, indices=indices)


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the choices (string literals escaped as JSON
    escapes them, characters outside ASCII kept as they are)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)

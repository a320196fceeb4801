"""Parse and validate a public GenerateRequest into a Job (tokenized, sampling validated).
Every error is a ValueError whose message names the field and its limit."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from engine.config import ModelConfig
from engine.request import SamplingParams
from engine.tokenizer import ChatTemplateError, Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from serving.convert import sampling_from_proto

MAX_REQUEST_ID_CHARS = 128
MAX_PROMPT_CHARS = 1_000_000


@dataclass(frozen=True)
class Job:
    request_id: str  # the caller's
    worker_request_id: str  # unique on the workers, whatever the callers send
    token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0


class Frontend:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, model_name: str):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name

    def parse(self, request: pb.GenerateRequest, arrival: float) -> Job:
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id is {len(request.request_id)} chars; the limit is "
                             f"{MAX_REQUEST_ID_CHARS}")
        if request.model and request.model != self.model_name:
            raise ValueError(f"model {request.model!r} is not served here; this cluster serves "
                             f"{self.model_name!r}")
        token_ids = self._tokens(request)
        try:
            params = sampling_from_proto(request.sampling)
        except ValueError as exc:
            message = str(exc)
            raise ValueError(message if message.startswith("sampling.")
                             else f"sampling.{message}") from None
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"prompt_token_ids contains {bad}, outside the vocabulary "
                             f"[0, {vocab})")
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"sampling.stop_token_ids contains {bad}, outside the vocabulary "
                             f"[0, {vocab})")
        limit = self.model_config.max_position_embeddings
        total = len(token_ids) + params.max_tokens
        if total > limit:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens})"
                             f" = {total} exceeds the model context of {limit} tokens")
        rid = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        return Job(rid, f"{rid}#{uuid.uuid4().hex[:8]}", token_ids, params, arrival)

    def tokens(self, request: pb.GenerateRequest) -> list[int]:
        """The prompt's token ids (ValueError naming the field when it has none)."""
        return self._tokens(request)

    def _tokens(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise ValueError("prompt must not be empty")
            if len(request.prompt) > MAX_PROMPT_CHARS:
                raise ValueError(f"prompt is {len(request.prompt)} chars; the limit is "
                                 f"{MAX_PROMPT_CHARS}")
            ids = self.tokenizer.encode(request.prompt)
        elif kind == "prompt_token_ids":
            ids = list(request.prompt_token_ids.ids)
        elif kind == "chat":
            ids = self._chat(request.chat)
        else:
            raise ValueError("one of prompt, prompt_token_ids or chat must be set")
        if not ids:
            raise ValueError(f"{kind} must not be empty (0 tokens)")
        return ids

    def _chat(self, chat: pb.ChatMessages) -> list[int]:
        if not chat.messages:
            raise ValueError("chat.messages must hold at least one message")
        messages = []
        for i, m in enumerate(chat.messages):
            if m.role not in ("system", "user", "assistant"):
                raise ValueError(f"chat.messages[{i}].role must be system, user or assistant, "
                                 f"got {m.role!r}")
            messages.append({"role": m.role, "content": m.content})
        try:
            return self.tokenizer.encode_chat(messages)
        except ChatTemplateError as exc:
            raise ValueError(f"chat: {exc}") from exc

"""Parse and validate a public GenerateRequest into a Job (tokenized, sampling validated), and
answer Tokenize / Detokenize with the same tokenizer, chat rendering and limits. Every error
is a ValueError whose message names the field and its limit."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from common.convert import DEFAULT_MAX_TOKENS, sampling_from_proto
from engine.config import ModelConfig
from engine.request import SamplingParams
from engine.tokenizer import ChatTemplateError, Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.limits import (
    CHAT_ROLES,
    MAX_LOGIT_BIAS_TOKENS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_REQUEST_ID_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    check_chat_size,
    check_sampling,
    check_structured_output,
    check_text,
    check_token_ids,
)
from router.frontdoor.tools import ToolPlan
from router.frontdoor.tools import plan as tools_plan
from router.request.forks import ForkRole


@dataclass(frozen=True)
class Job:
    request_id: str  # the caller's
    worker_request_id: str  # unique on the workers, whatever the callers send
    token_ids: list[int]
    params: SamplingParams
    arrival: float = 0.0
    tools: ToolPlan | None = None  # tool_choice set: how the output becomes tool calls
    fork: ForkRole | None = None  # one of n samples of its prompt (router.request.forks)


class Frontend:
    def __init__(self, tokenizer: Tokenizer, model_config: ModelConfig, model_name: str):
        self.tokenizer = tokenizer
        self.model_config = model_config
        self.model_name = model_name
        self.eos_token_ids = frozenset(tokenizer.end_token_ids(model_config.eos_token_ids))

    def stop_token_ids(self, params: SamplingParams) -> frozenset[int]:
        """The tokens that end a request with these parameters (EOS, its stop_token_ids)."""
        ids = frozenset(params.stop_token_ids)
        return ids if params.ignore_eos else ids | self.eos_token_ids

    def parse(self, request: pb.GenerateRequest, arrival: float, rest_of_context: bool = False
              ) -> Job:
        """The request as a Job; `rest_of_context`: max_tokens, when not set, is the rest of the
        model's context after the prompt (OpenAI chat's default, as vLLM does)."""
        if len(request.request_id) > MAX_REQUEST_ID_CHARS:
            raise ValueError(f"request_id is {len(request.request_id)} chars; the limit is "
                             f"{MAX_REQUEST_ID_CHARS}")
        self._check_model(request.model)
        limit = self.model_config.max_position_embeddings
        # Without max_tokens, chat's default is the rest of the context: min_tokens is checked
        # against that, once the prompt's length is known.
        params = self._sampling(request.sampling, limit if rest_of_context else None)
        token_ids = self._tokens(request)  # after every check that needs no tokenizer
        self._check_ids("prompt_token_ids", token_ids)
        if rest_of_context and not request.sampling.HasField("max_tokens"):
            params = dataclasses.replace(params, max_tokens=max(1, limit - len(token_ids)))
        if params.continued_tokens >= len(token_ids):
            raise ValueError(f"sampling.continued_tokens ({params.continued_tokens}) must be less "
                             f"than the prompt's {len(token_ids)} tokens")
        total = len(token_ids) + params.max_tokens
        if total > limit:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens ({params.max_tokens})"
                             f" = {total} exceeds the model context of {limit} tokens")
        tools = None
        if request.HasField("tool_choice"):
            tools, params = self._tool_choice(request, params)
        rid = request.request_id or f"gen-{uuid.uuid4().hex[:12]}"
        return Job(rid, f"{rid}#{uuid.uuid4().hex[:8]}", token_ids, params, arrival, tools)

    def _tool_choice(self, request: pb.GenerateRequest, params: SamplingParams
                     ) -> tuple[ToolPlan, SamplingParams]:
        """The plan for the request's tool_choice, and its params holding the output to it."""
        if request.WhichOneof("input") != "chat":
            raise ValueError("tool_choice needs a chat input")
        choice = request.tool_choice
        kind = choice.WhichOneof("choice")
        if kind is None or (kind == "mode" and choice.mode not in ("none", "auto", "required")):
            raise ValueError(f"tool_choice.mode must be none, auto or required, got "
                             f"{choice.mode!r}")
        wanted = choice.mode if kind == "mode" else {"function": {"name": choice.function}}
        try:
            plan, constraint = tools_plan(_tools(request.chat.tools_json) or [], wanted,
                                          self.tokenizer.knows_tool_calls)
        except ValueError as exc:
            raise ValueError(f"tool_choice: {exc}") from None
        if constraint is not None:
            if params.structured_output is not None:
                raise ValueError(f"tool_choice {plan.mode} holds the output to a call: "
                                 "sampling.structured_output must be unset")
            check_structured_output(constraint)
            params = dataclasses.replace(params, structured_output=constraint)
        return plan, params

    def tokenize(self, request: pb.TokenizeRequest) -> pb.TokenizeResponse:
        """The Tokenize call: the same limits and chat rendering as a generation's prompt."""
        self._check_model(request.model)
        kind = request.WhichOneof("input")
        special = request.add_special_tokens if request.HasField("add_special_tokens") else None
        if kind == "prompt":
            check_text("prompt", len(request.prompt), len(request.prompt.encode()))
            ids = self.tokenizer.encode(request.prompt, special is not False)
        elif kind == "chat":
            generation = (request.add_generation_prompt
                          if request.HasField("add_generation_prompt") else True)
            ids = self._chat(request.chat, generation, special is True)
        else:
            raise ValueError("one of prompt or chat must be set")
        reply = pb.TokenizeResponse(token_ids=ids, count=len(ids),
                                    max_model_len=self.model_config.max_position_embeddings)
        if request.return_token_strs:
            reply.token_strs.extend(self.tokenizer.id_to_token(t) for t in ids)
        return reply

    def detokenize(self, request: pb.DetokenizeRequest) -> pb.DetokenizeResponse:
        self._check_model(request.model)
        check_token_ids("token_ids", len(request.token_ids), MAX_PROMPT_TOKEN_IDS)
        self._check_ids("token_ids", request.token_ids)
        text = self.tokenizer.decode(list(request.token_ids), skip_special_tokens=False)
        return pb.DetokenizeResponse(text=text)

    def _check_model(self, model: str) -> None:
        if model and model != self.model_name:
            raise ValueError(f"model {model!r} is not served here; this cluster serves "
                             f"{self.model_name!r}")

    def _sampling(self, options: pb.SamplingOptions, default_max_tokens: int | None = None
                  ) -> SamplingParams:
        try:
            check_sampling(options.temperature)  # before top_p 0 makes it greedy
            params = sampling_from_proto(options, default_max_tokens or DEFAULT_MAX_TOKENS)
        except ValueError as exc:
            message = str(exc)
            raise ValueError(message if message.startswith("sampling.")
                             else f"sampling.{message}") from None
        if len(params.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"sampling.stop holds {len(params.stop)} stop strings; the limit "
                             f"is {MAX_STOP_STRINGS}")
        check_text("sampling.stop", sum(len(s) for s in params.stop),
                   sum(len(s.encode()) for s in params.stop))
        check_token_ids("sampling.stop_token_ids", len(params.stop_token_ids),
                        MAX_STOP_TOKEN_IDS)
        self._check_ids("sampling.stop_token_ids", params.stop_token_ids)
        check_token_ids("sampling.logit_bias", len(params.logit_bias), MAX_LOGIT_BIAS_TOKENS)
        self._check_ids("sampling.logit_bias", [t for t, _ in params.logit_bias])
        if params.structured_output is not None:
            check_structured_output(params.structured_output)
        return params

    def _check_ids(self, field: str, token_ids: Sequence[int]) -> None:
        vocab = self.model_config.vocab_size
        bad = next((t for t in token_ids if t >= vocab), None)
        if bad is not None:
            raise ValueError(f"{field} contains {bad}, outside the vocabulary [0, {vocab})")

    def _tokens(self, request: pb.GenerateRequest) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            if not request.prompt:
                raise ValueError("prompt must not be empty")
            check_text("prompt", len(request.prompt), len(request.prompt.encode()))
            ids = self.tokenizer.encode(request.prompt)
        elif kind == "prompt_token_ids":
            check_token_ids("prompt_token_ids", len(request.prompt_token_ids.ids),
                            MAX_PROMPT_TOKEN_IDS)
            ids = list(request.prompt_token_ids.ids)
        elif kind == "chat":
            ids = self._chat(request.chat)
        else:
            raise ValueError("one of prompt, prompt_token_ids or chat must be set")
        if not ids:
            raise ValueError(f"{kind} must not be empty (0 tokens)")
        return ids

    def _chat(self, chat: pb.ChatMessages, add_generation_prompt: bool = True,
              add_special_tokens: bool = False) -> list[int]:
        check_chat_size(chat)
        tools = _tools(chat.tools_json)
        try:
            return self.tokenizer.encode_chat([_message(i, m)
                                               for i, m in enumerate(chat.messages)],
                                              add_generation_prompt, add_special_tokens, tools)
        except ChatTemplateError as exc:
            raise ValueError(f"chat: {exc}") from exc


def _tools(tools_json: str) -> list[dict[str, Any]] | None:
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except json.JSONDecodeError as exc:
        raise ValueError(f"chat.tools_json is not valid JSON: {exc}") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise ValueError("chat.tools_json must be a JSON list of tool objects")
    return tools


def _message(index: int, message: pb.ChatMessage) -> dict[str, Any]:
    """One turn as the chat template takes it: `developer` is system (as OpenAI treats it); a
    `tool` turn carries the id of the call it answers; an assistant turn its tool calls (their
    arguments as objects, as templates index them)."""
    if message.role not in CHAT_ROLES:
        raise ValueError(f"chat.messages[{index}].role must be one of {', '.join(CHAT_ROLES)}, "
                         f"got {message.role!r}")
    if message.role == "tool" and not message.tool_call_id:
        raise ValueError(f"chat.messages[{index}].tool_call_id is required for role tool")
    turn = {"role": "system" if message.role == "developer" else message.role,
            "content": message.content}
    if message.tool_call_id:
        turn["tool_call_id"] = message.tool_call_id
    if message.name:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
            "name": c.name, "arguments": _arguments(c.arguments)}} for c in message.tool_calls]
    return turn


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text  # as sent: the template shows it verbatim

"""OpenAI's HTTP API <-> the router's requests: JSON bodies of /v1/completions and
/v1/chat/completions become a pb.GenerateRequest (the same request the gRPC API takes, so
everything after this — validation, admission, placement — is shared), and the router's responses
become OpenAI's JSON objects and stream chunks. Plain Python over dicts; router.frontdoor.http_api
serves it.

Fields: model, prompt (text, token ids, or a batch of either), messages (roles system, developer,
user, assistant, tool; text content or text parts), max_tokens / max_completion_tokens,
temperature (default 1, as OpenAI's), top_p (0: the top token only, i.e. greedy), top_k, seed
(any int64), stop, stop_token_ids, ignore_eos, logprobs / top_logprobs, presence_penalty,
frequency_penalty, repetition_penalty, logit_bias, min_tokens, skip_special_tokens,
include_stop_str_in_output, echo (completions: the prompt
before the completion, with its logprobs when logprobs is set), n, stream,
stream_options.include_usage / continuous_usage_stats, user. Anything the cluster cannot honour
(echo on chat, best_of, functions, suffix, spaces_between_special_tokens false) is refused
with 400 naming it. Batches of prompts
and n samples become one request per choice; response_format / structured_outputs / guided_*
and tool_choice become the request's output constraint (router.frontdoor.tools).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from pydantic import ValidationError

from common.convert import structured_to_proto
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.choices import expand
from router.frontdoor.limits import check_chat_size, check_text
from router.frontdoor.openai_schema import (
    ChatRequest,
    CompletionRequest,
    UnsupportedField,
    describe,
)
from router.frontdoor.tools import ToolPlan
from router.frontdoor.tools import plan as tools_plan

FINISH = {pb.FINISH_REASON_STOP: "stop", pb.FINISH_REASON_LENGTH: "length",
          pb.FINISH_REASON_ABORT: "abort"}
# gRPC status -> (HTTP status, OpenAI error type)
HTTP_ERRORS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error"),
}
# The gRPC API's field names in shared validation messages, as this API spells them.
RENAMES = (("prompt_token_ids", "prompt"), ("chat.messages", "messages"), ("sampling.", ""),
           ("chat:", "messages:"))


FIELD_NAME = re.compile(r"[a-z_]+(\[\d+\])?(\.[a-z_]+(\[\d+\])?)*")


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = (
            status, message, kind, param, code)

    @classmethod
    def from_status(cls, code: grpc.StatusCode, message: str) -> ApiError:
        status, kind = HTTP_ERRORS.get(code, (500, "server_error"))
        for grpc_name, http_name in RENAMES:
            message = message.replace(grpc_name, http_name)
        field = message.split(" ", 1)[0].rstrip(":")  # messages start with the field's name
        param = field if status == 400 and FIELD_NAME.fullmatch(field) else None
        return cls(status, message, kind, param)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


# HTTP status -> the gRPC code the router counts it as (pdserve_router_requests_total)
GRPC_CODES = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND,
              413: grpc.StatusCode.INVALID_ARGUMENT, 415: grpc.StatusCode.INVALID_ARGUMENT,
              429: grpc.StatusCode.RESOURCE_EXHAUSTED, 499: grpc.StatusCode.CANCELLED,
              503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.DEADLINE_EXCEEDED}


def grpc_code(http_status: int) -> grpc.StatusCode:
    return GRPC_CODES.get(http_status, grpc.StatusCode.INTERNAL)


def bad(param: str, message: str) -> ApiError:
    """400 for `param`; the message starts with the field's name (once: a message from a
    shared check may name it already)."""
    return ApiError(400, message if message.startswith(param) else f"{param} {message}",
                    param=param)


@dataclass(frozen=True)
class ApiRequest:
    """A parsed OpenAI request: what to run, and how to answer."""

    chat: bool
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs; k: the top k alternatives too
    max_tokens_given: bool
    continuous_usage: bool = False  # usage on every stream chunk
    echo: bool = False  # completions: the prompt's text (and logprobs) before the completion's
    # Every choice's own request, in choice order (a batch of prompts x n): `request` is the
    # first; the others differ in prompt, request id and seed
    choices: tuple[pb.GenerateRequest, ...] = ()
    n: int = 1  # choices per prompt: choice i is sample i % n of prompt i // n
    tools: ToolPlan | None = None  # chat with tools: how the output becomes tool calls

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"

    @property
    def all_choices(self) -> tuple[pb.GenerateRequest, ...]:
        return self.choices or (self.request,)


def parse(body: object, chat: bool, model_name: str, template_knows_calls: bool = False
          ) -> ApiRequest:
    """A request body (ApiError 400 naming the field and its limit, 404 for another model).
    Types and wire ranges are checked here (openai_schema); the limits both front doors
    share are checked later, once, by the router's frontend. `template_knows_calls`: the chat
    template writes Hermes-style tool calls (tool_choice auto is allowed)."""
    parsed = _validated(body, chat, model_name)
    request = pb.GenerateRequest(request_id=f"{'chatcmpl' if chat else 'cmpl'}-"
                                 f"{uuid.uuid4().hex[:24]}", model=parsed.model)
    tools = None
    if isinstance(parsed, ChatRequest):
        _chat(parsed, request.chat)
        tools = _tool_plan(parsed, request.chat, template_knows_calls)
    logprobs = _logprobs(parsed)
    request.sampling.CopyFrom(_sampling(parsed, logprobs, tools))
    options = parsed.stream_options
    if options is not None and not parsed.stream:
        raise bad("stream_options", "is only allowed with stream: true")
    include_usage = bool(options and options.include_usage)
    echo = isinstance(parsed, CompletionRequest) and bool(parsed.echo)
    if echo and logprobs is not None:  # the prompt's logprobs, from whichever worker computes it
        request.sampling.prompt_logprobs = logprobs
    prompts = parsed.prompt if isinstance(parsed, CompletionRequest) else [None]
    if len(prompts) * (parsed.n or 1) > 1:
        _check_sizes(request, prompts)
    try:
        choices = expand(request, prompts, parsed.n or 1)
    except ValueError as exc:  # "n x ... choices; the limit is ..."
        raise ApiError(400, str(exc), param="n") from None
    return ApiRequest(chat, choices[0], bool(parsed.stream), include_usage, logprobs,
                      request.sampling.HasField("max_tokens"),
                      include_usage and bool(options and options.continuous_usage_stats), echo,
                      tuple(choices), parsed.n or 1, tools[0] if tools else None)


def _check_sizes(request: pb.GenerateRequest, prompts: list[str | list[int] | None]) -> None:
    """The size limits each copy would be refused for, checked before n copies the request (an
    8 MiB body copied 256 times would hold the router's memory first)."""
    try:
        if request.WhichOneof("input") == "chat":
            check_chat_size(request.chat)
        for prompt in prompts:
            if isinstance(prompt, str):
                check_text("prompt", len(prompt), len(prompt.encode()))
    except ValueError as exc:  # as the router's frontend would refuse each copy
        raise ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None


def _validated(body: object, chat: bool, model_name: str) -> CompletionRequest | ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    schema = ChatRequest if chat else CompletionRequest
    try:
        parsed = schema.model_validate(body)
        parsed.refuse_unsupported()
    except ValidationError as exc:
        field, message = describe(exc)
        raise ApiError(400, message, param=field) from None
    except UnsupportedField as exc:
        raise bad(exc.field, str(exc)) from None
    if parsed.model != model_name:
        raise ApiError(404, f"The model `{parsed.model}` does not exist; this server serves "
                       f"`{model_name}`", "not_found_error", "model", "model_not_found")
    return parsed


def _chat(parsed: ChatRequest, chat: pb.ChatMessages) -> None:
    for message in parsed.messages:
        turn = chat.messages.add(role=message.role, content=message.content,
                                 tool_call_id=message.tool_call_id or "", name=message.name or "")
        for call in message.tool_calls or []:
            turn.tool_calls.add(id=call.id, name=call.function.name,
                                arguments=call.function.arguments)
    if parsed.tools:
        chat.tools_json = json.dumps([t.model_dump(exclude_none=True) for t in parsed.tools])


def _tool_plan(parsed: ChatRequest, chat: pb.ChatMessages, template_knows_calls: bool
               ) -> tuple[ToolPlan, pb.StructuredOutput | None] | None:
    """How tools are used, and the constraint that holds the model to them (None: no tools)."""
    if not parsed.tools and parsed.tool_choice in (None, "none"):
        return None
    choice = parsed.tool_choice
    tools = json.loads(chat.tools_json) if chat.tools_json else []
    try:
        plan, constraint = tools_plan(tools, choice if not hasattr(choice, "model_dump")
                                      else choice.model_dump(), template_knows_calls)
    except ValueError as exc:
        raise bad("tool_choice", str(exc)) from None
    return plan, None if constraint is None else structured_to_proto(constraint)


def _logprobs(parsed: CompletionRequest | ChatRequest) -> int | None:
    if isinstance(parsed, CompletionRequest):
        return parsed.logprobs
    if not parsed.logprobs:
        if parsed.top_logprobs is not None:
            raise bad("top_logprobs", "needs logprobs: true")
        return None
    return parsed.top_logprobs or 0


def _sampling(parsed: CompletionRequest | ChatRequest, logprobs: int | None,
              tools: tuple[ToolPlan, pb.StructuredOutput | None] | None = None
              ) -> pb.SamplingOptions:
    """The gRPC API's sampling options; absent fields keep OpenAI's defaults (temperature 1,
    16 tokens for completions, the rest of the context for chat)."""
    options = pb.SamplingOptions(
        temperature=1.0 if parsed.temperature is None else parsed.temperature,
        top_k=-1 if parsed.top_k is None else parsed.top_k,
        ignore_eos=bool(parsed.ignore_eos), stop=parsed.stop,
        stop_token_ids=parsed.stop_token_ids or [],
        include_stop_str_in_output=bool(parsed.include_stop_str_in_output))
    if parsed.skip_special_tokens is not None:
        options.skip_special_tokens = parsed.skip_special_tokens
    if parsed.top_p is not None:
        options.top_p = parsed.top_p
    maximum = (parsed.max_completion_tokens if isinstance(parsed, ChatRequest)
               and parsed.max_completion_tokens is not None else parsed.max_tokens)
    if maximum is not None:
        options.max_tokens = maximum
    elif isinstance(parsed, CompletionRequest):
        options.max_tokens = 16  # OpenAI's default for completions
    if parsed.seed is not None:
        options.seed = parsed.seed % (1 << 64)  # int64 -> uint64, one to one
    _logit_processing(parsed, options)
    constraint = _structured(parsed)
    if tools is not None and tools[1] is not None:
        if constraint is not None:
            raise bad("tool_choice", f"{tools[0].mode} holds the output to a tool's arguments; "
                      "it cannot take a response format or another output constraint too")
        constraint = tools[1]
    if constraint is not None:
        options.structured_output.CopyFrom(constraint)
    if logprobs is not None:
        options.logprobs = logprobs
    return options


def _logit_processing(parsed: CompletionRequest | ChatRequest,
                      options: pb.SamplingOptions) -> None:
    """Penalties, logit_bias and min_tokens: absent or null keeps each one off. Their limits are
    checked once, with the gRPC API's (the wire's float32 carries the values)."""
    options.presence_penalty = parsed.presence_penalty or 0.0
    options.frequency_penalty = parsed.frequency_penalty or 0.0
    if parsed.repetition_penalty is not None:
        options.repetition_penalty = parsed.repetition_penalty
    options.min_tokens = parsed.min_tokens or 0
    for token, bias in (parsed.logit_bias or {}).items():
        options.logit_bias[int(token)] = bias


def _structured(parsed: CompletionRequest | ChatRequest) -> pb.StructuredOutput | None:
    """response_format (json_object, json_schema) or vLLM's structured_outputs / guided_*
    extensions, one at most, as the gRPC API's constraint."""
    found: list[tuple[str, pb.StructuredOutput]] = []
    fmt = parsed.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", pb.StructuredOutput(json_object=True)))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad("response_format.json_schema", "is required for type json_schema")
        found.append(("response_format", pb.StructuredOutput(
            json_schema=json.dumps(fmt.json_schema.json_schema))))
    extension = parsed.structured_outputs
    for name, schema, regex, choice in (
            ("structured_outputs", extension and extension.json_schema,
             extension and extension.regex, extension and extension.choice),
            ("guided_*", parsed.guided_json, parsed.guided_regex, parsed.guided_choice)):
        if schema is not None:
            text = schema if isinstance(schema, str) else json.dumps(schema)
            found.append((name, pb.StructuredOutput(json_schema=text)))
        if regex is not None:
            found.append((name, pb.StructuredOutput(regex=regex)))
        if choice is not None:
            found.append((name, pb.StructuredOutput(choice=pb.Choices(choices=choice))))
    if extension is not None and extension.json_object:
        found.append(("structured_outputs", pb.StructuredOutput(json_object=True)))
    if len(found) > 1:
        raise bad(found[1][0], "sets a second output constraint; one is allowed "
                  f"(already: {found[0][0]})")
    return found[0][1] if found else None


# ---- responses ----------------------------------------------------------------------------

def usage(u: pb.Usage) -> dict:
    return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens}}


def timings(last: pb.GenerateResponse) -> dict:
    """The latency breakdown (an extension field: OpenAI clients keep unknown fields)."""
    t = last.timings
    return {"router_queue_s": t.router_queue_s, "prefill_queue_s": t.prefill_queue_s,
            "prefill_compute_s": t.prefill_compute_s, "kv_transfer_s": t.kv_transfer_s,
            "kv_transfer_bytes": t.kv_transfer_bytes, "kv_transport": t.kv_transport,
            "decode_admission_s": t.decode_admission_s, "ttft_s": t.ttft_s, "e2e_s": t.e2e_s,
            "prefill_site": t.prefill_site, "live_migrations": t.live_migrations,
            "live_migration_bytes": t.live_migration_bytes,
            "live_migration_pause_s": t.live_migration_pause_s}


def envelope(api: ApiRequest, request_id: str, model: str, chunk: bool) -> dict:
    kind = ("chat.completion" if api.chat else "text_completion") + \
        (".chunk" if chunk and api.chat else "")
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


def logprobs_json(api: ApiRequest, items: list[pb.TokenLogprob],
                  token_text: Callable[[int], str], offset: int = 0,
                  echoed: list[int] | None = None,
                  prompt_logprobs: list[pb.TokenLogprob] | None = None) -> dict | None:
    """OpenAI's logprobs object for these tokens (chat: `content`; completions: parallel
    lists), or None when none were asked for. A token's top alternatives are the k most likely,
    the sampled one among them when it is. `echoed`: completions with echo, the prompt's tokens
    first (the first with a null logprob, the others with `prompt_logprobs`)."""
    if api.logprobs is None:
        return None
    if echoed:
        return _echoed_logprobs(api.logprobs, echoed, prompt_logprobs or [], items, token_text)
    tops = [_top(item, api.logprobs) for item in items]
    if api.chat:
        return {"content": [{
            "token": token_text(i.token_id), "logprob": i.logprob,
            "bytes": list(token_text(i.token_id).encode()),
            "top_logprobs": [{"token": token_text(t), "logprob": lp,
                              "bytes": list(token_text(t).encode())} for t, lp in top]}
            for i, top in zip(items, tops)]}
    texts = [token_text(i.token_id) for i in items]
    offsets = [offset + sum(len(t) for t in texts[:k]) for k in range(len(texts))]
    return {"tokens": texts, "token_logprobs": [i.logprob for i in items],
            "top_logprobs": [{token_text(t): lp for t, lp in top} for top in tops],
            "text_offset": offsets}


def _echoed_logprobs(k: int, prompt: list[int], prompt_logprobs: list[pb.TokenLogprob],
                     items: list[pb.TokenLogprob], token_text: Callable[[int], str]) -> dict:
    """Completions with echo: the prompt's tokens, then the completion's, as one set of lists
    whose text offsets start at the prompt's first character."""
    if len(prompt_logprobs) != len(prompt) - 1:
        raise ValueError(f"{len(prompt_logprobs)} prompt logprobs for {len(prompt)} prompt "
                         "tokens")
    entries = [None, *prompt_logprobs, *items]
    texts = [token_text(prompt[0])] + [token_text(e.token_id) for e in entries[1:]]
    offsets = [sum(len(t) for t in texts[:i]) for i in range(len(texts))]
    return {"tokens": texts,
            "token_logprobs": [None if e is None else e.logprob for e in entries],
            "top_logprobs": [None if e is None else {token_text(t): lp for t, lp in _top(e, k)}
                             for e in entries],
            "text_offset": offsets}


def _top(item: pb.TokenLogprob, k: int) -> list[tuple[int, float]]:
    candidates = {**dict(item.top), item.token_id: item.logprob}
    return sorted(candidates.items(), key=lambda kv: -kv[1])[:k]

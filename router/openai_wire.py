"""OpenAI's HTTP API <-> the router's requests: JSON bodies of /v1/completions and
/v1/chat/completions become a pb.GenerateRequest (the same request the gRPC API takes, so
everything after this — validation, admission, placement — is shared), and the router's responses
become OpenAI's JSON objects and stream chunks. Plain Python over dicts; router.http_api serves it.

Fields: model, prompt (text, token ids, or a batch of one), messages (text content, or text
parts), max_tokens / max_completion_tokens, temperature (default 1, as OpenAI's), top_p, top_k,
seed, stop, stop_token_ids, ignore_eos, logprobs / top_logprobs, n = 1, stream, stream_options
.include_usage, user. Anything the cluster cannot honour (n > 1, echo, best_of, penalties,
logit_bias, tools, suffix, a response_format other than text) is refused with 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from pdserve_proto import pdserve_pb2 as pb

MAX_TOP_LOGPROBS = 20
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
UNSUPPORTED = {"echo": False, "best_of": 1, "presence_penalty": 0, "frequency_penalty": 0,
               "logit_bias": None, "suffix": None, "tools": None, "functions": None}
# The gRPC API's field names in shared validation messages, as this API spells them.
RENAMES = (("prompt_token_ids", "prompt"), ("chat.messages", "messages"), ("sampling.", ""),
           ("chat:", "messages:"))


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
        return cls(status, message, kind)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.code}}


def bad(param: str, message: str) -> ApiError:
    return ApiError(400, f"{param} {message}", param=param)


@dataclass(frozen=True)
class ApiRequest:
    """A parsed OpenAI request: what to run, and how to answer."""

    chat: bool
    request: pb.GenerateRequest
    stream: bool
    include_usage: bool
    logprobs: int | None  # None: no logprobs; k: the top k alternatives too
    max_tokens_given: bool

    @property
    def id_prefix(self) -> str:
        return "chatcmpl" if self.chat else "cmpl"


def parse(body: object, chat: bool, model_name: str) -> ApiRequest:
    """A request body (ApiError 400 naming the field and its limit, 404 for another model)."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("model", "is required (a string)")
    if model != model_name:
        raise ApiError(404, f"The model `{model}` does not exist; this server serves "
                       f"`{model_name}`", "not_found_error", "model", "model_not_found")
    _refuse_unsupported(body)
    request = pb.GenerateRequest(request_id=f"{'chatcmpl' if chat else 'cmpl'}-"
                                 f"{uuid.uuid4().hex[:24]}", model=model)
    if chat:
        _messages(body.get("messages"), request)
    else:
        _prompt(body.get("prompt"), request)
    logprobs = _logprobs(body, chat)
    request.sampling.CopyFrom(_sampling(body, chat, logprobs))
    stream = _flag(body, "stream")
    options = body.get("stream_options")
    if options is not None and (not stream or not isinstance(options, dict)):
        raise bad("stream_options", "is only allowed with stream: true (an object)")
    return ApiRequest(chat, request, stream, bool((options or {}).get("include_usage")),
                      logprobs, request.sampling.HasField("max_tokens"))


def _refuse_unsupported(body: dict) -> None:
    n = body.get("n", 1)
    if n != 1:
        raise bad("n", f"must be 1 (one choice per request), got {n!r}")
    for field, neutral in UNSUPPORTED.items():
        value = body.get(field, neutral)
        if value not in (neutral, None, [], {}):
            raise bad(field, f"is not supported here (got {value!r})")
    response_format = body.get("response_format")
    if response_format not in (None, {"type": "text"}):
        raise bad("response_format", "is not supported here: only {\"type\": \"text\"}")


def _prompt(prompt: object, request: pb.GenerateRequest) -> None:
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        request.prompt = prompt
    elif isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        request.prompt_token_ids.ids.extend(prompt)
    elif isinstance(prompt, list) and len(prompt) > 1 and all(
            isinstance(p, (str, list)) for p in prompt):
        raise bad("prompt", f"holds {len(prompt)} prompts; batches of more than one are not "
                  "supported (send one request per prompt)")
    else:
        raise bad("prompt", "must be a string or a non-empty list of token ids (ints >= 0)")


def _messages(messages: object, request: pb.GenerateRequest) -> None:
    if not isinstance(messages, list) or not messages:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise bad(f"messages[{i}]", "must be an object with a role and a content")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise bad(f"messages[{i}].content", "parts must all be {type: text, text}")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise bad(f"messages[{i}].content", "must be a string or a list of text parts")
        request.chat.messages.add(role=message["role"], content=content)


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        top = body.get("top_logprobs")
        if not _flag(body, "logprobs"):
            if top is not None:
                raise bad("top_logprobs", "needs logprobs: true")
            return None
        return _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS, default=0)
    if body.get("logprobs") is None:
        return None
    return _int(body, "logprobs", 0, MAX_TOP_LOGPROBS)


def _sampling(body: dict, chat: bool, logprobs: int | None) -> pb.SamplingOptions:
    options = pb.SamplingOptions(
        temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, default=1.0),
        top_k=_int(body, "top_k", -1, 1 << 20, default=-1),
        ignore_eos=_flag(body, "ignore_eos"))
    names = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    given = next((name for name in names if body.get(name) is not None), None)
    if given is not None:
        options.max_tokens = _int(body, given, 1, 1 << 30)
    elif not chat:
        options.max_tokens = 16  # OpenAI's default for completions
    if body.get("seed") is not None:
        options.seed = _int(body, "seed", 0, (1 << 64) - 1)
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else stop or []
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad("stop", "must be a non-empty string or a list of them")
    options.stop.extend(stops)
    ids = body.get("stop_token_ids") or []
    if not isinstance(ids, list) or not all(isinstance(t, int) and t >= 0 for t in ids):
        raise bad("stop_token_ids", "must be a list of token ids (ints >= 0)")
    options.stop_token_ids.extend(ids)
    if logprobs is not None:
        options.logprobs = logprobs
    return options


def _flag(body: dict, name: str) -> bool:
    value = body.get(name, False)
    if value is not None and not isinstance(value, bool):
        raise bad(name, f"must be true or false, got {value!r}")
    return bool(value)


def _number(body: dict, name: str, low: float, high: float, default: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise bad(name, f"must be a number in [{low:g}, {high:g}], got {value!r}")
    return float(value)


def _int(body: dict, name: str, low: int, high: int, default: int | None = None) -> int:
    value = body.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise bad(name, f"must be an integer in [{low}, {high}], got {value!r}")
    return value


# ---- responses ----------------------------------------------------------------------------

def usage(last: pb.GenerateResponse) -> dict:
    u = last.usage
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
            "prefill_site": t.prefill_site}


def envelope(api: ApiRequest, request_id: str, model: str, chunk: bool) -> dict:
    kind = ("chat.completion" if api.chat else "text_completion") + \
        (".chunk" if chunk and api.chat else "")
    return {"id": request_id, "object": kind, "created": int(time.time()), "model": model}


def logprobs_json(api: ApiRequest, items: list[pb.TokenLogprob],
                  token_text: Callable[[int], str], offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for these tokens (chat: `content`; completions: parallel
    lists), or None when none were asked for. A token's top alternatives are the k most likely,
    the sampled one among them when it is."""
    if api.logprobs is None:
        return None
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


def _top(item: pb.TokenLogprob, k: int) -> list[tuple[int, float]]:
    candidates = {**dict(item.top), item.token_id: item.logprob}
    return sorted(candidates.items(), key=lambda kv: -kv[1])[:k]

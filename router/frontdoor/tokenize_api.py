"""vLLM's `POST /tokenize` and `POST /detokenize` bodies <-> the gRPC API's Tokenize and
Detokenize requests. Bodies are pydantic models (types and what fits the wire); every limit is
the Frontend's, shared with the gRPC calls.

/tokenize takes `prompt` (text; `add_special_tokens` defaults to true) or `messages` (rendered
with the chat template; `add_generation_prompt` true and `add_special_tokens` false by default),
and `return_token_strs`; it answers `{"count", "max_model_len", "tokens", "token_strs"}`.
/detokenize takes `tokens` and answers `{"prompt": text}`."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.openai_codec import ApiError
from router.frontdoor.openai_schema import ChatMessage, Text, TokenId, describe


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: Text | None = None  # optional, as in vLLM; when given it must be the served model


class TokenizeBody(_Body):
    prompt: Text | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = None


class DetokenizeBody(_Body):
    tokens: list[TokenId]


def tokenize_request(body: object) -> pb.TokenizeRequest:
    parsed = _parse(TokenizeBody, body)
    if (parsed.prompt is None) == (parsed.messages is None):
        raise ApiError(400, "exactly one of prompt or messages must be given", param="prompt")
    request = pb.TokenizeRequest(model=parsed.model or "",
                                 return_token_strs=bool(parsed.return_token_strs))
    if parsed.prompt is not None:
        request.prompt = parsed.prompt
    else:
        for message in parsed.messages or []:
            request.chat.messages.add(role=message.role, content=message.content,
                                      tool_call_id=message.tool_call_id or "",
                                      name=message.name or "")
    if parsed.add_special_tokens is not None:
        request.add_special_tokens = parsed.add_special_tokens
    if parsed.add_generation_prompt is not None:
        request.add_generation_prompt = parsed.add_generation_prompt
    return request


def detokenize_request(body: object) -> pb.DetokenizeRequest:
    parsed = _parse(DetokenizeBody, body)
    return pb.DetokenizeRequest(model=parsed.model or "", token_ids=parsed.tokens)


def tokenize_json(reply: pb.TokenizeResponse, strs: bool) -> dict:
    return {"count": reply.count, "max_model_len": reply.max_model_len,
            "tokens": list(reply.token_ids),
            "token_strs": list(reply.token_strs) if strs else None}


def detokenize_json(reply: pb.DetokenizeResponse) -> dict:
    return {"prompt": reply.text}


def _parse(schema: type[_Body], body: object) -> _Body:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    try:
        return schema.model_validate(body)
    except ValidationError as exc:
        field, message = describe(exc)
        raise ApiError(400, message, param=field) from None

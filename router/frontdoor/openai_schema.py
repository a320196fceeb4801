"""The JSON bodies of OpenAI's /v1/completions and /v1/chat/completions as pydantic models (as
vLLM's protocol layer parses them): types, the wire's integer ranges and the fields this server
cannot honour are checked here; every other limit (temperature <= 2, logprobs <= 20, text
sizes...) is the gRPC API's (router.frontdoor.limits), checked once for both front doors. A
validation
error becomes one 400 message naming the field."""

from __future__ import annotations

import reprlib
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator

from router.frontdoor.limits import (
    MAX_CHOICES,
    MAX_LOGPROBS,
    MAX_PROMPT_TOKEN_IDS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOOLS,
)

UINT32_MAX = (1 << 32) - 1
INT32 = Field(ge=-(1 << 31), le=(1 << 31) - 1)
# OpenAI takes any int64 seed; the gRPC API's is a uint64 (negative seeds map to it one to one).
INT64 = Field(ge=-(1 << 63), le=(1 << 63) - 1)
# How a refused value is quoted in a message: its start only, however large it is.
SHORT = reprlib.Repr()
SHORT.maxstring, SHORT.maxother, SHORT.maxlist, SHORT.maxdict = 60, 60, 6, 4


def _utf8(text: str) -> str:
    """JSON can carry a lone surrogate (\\ud800), which is no text and cannot be encoded."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"is not valid UTF-8 text (a lone surrogate at character "
                         f"{exc.start})") from None
    return text


Text = Annotated[str, AfterValidator(_utf8)]
TokenId = Annotated[int, Field(ge=0, le=UINT32_MAX)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
# Fields this server cannot honour yet, with the value that means "not used".
UNSUPPORTED = {"echo": False, "best_of": 1, "suffix": None, "tools": None, "functions": None,
               "tool_choice": "none", "function_call": None,  # tools: ChatRequest's own fields
               # vLLM's extensions this server does not honour: set to anything but their
               # neutral value, each is refused rather than ignored
               "spaces_between_special_tokens": True, "min_p": 0.0, "guided_grammar": None,
               "allowed_token_ids": None, "bad_words": None, "truncate_prompt_tokens": None,
               "use_beam_search": False, "length_penalty": 1.0, "prompt_logprobs": None,
               "chat_template_kwargs": None}
# The same for vLLM's structured_outputs: the constraint kinds this server has not
STRUCTURED_UNSUPPORTED = ("grammar", "structural_tag")


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # usage on every chunk (guidellm asks for it)


class JsonSchemaFormat(BaseModel):
    """response_format.json_schema: OpenAI's structured outputs (strict or not, the output is
    held to the schema)."""

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: Text | None = None
    description: Text | None = None
    json_schema: dict[str, Any] | bool = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    json_schema: dict[str, Any] | bool | Text | None = Field(None, alias="json")
    regex: Text | None = None
    choice: Annotated[list[Text], Field(min_length=1)] | None = None
    json_object: bool | None = None


class _Request(BaseModel):
    """What both endpoints take; unknown fields are ignored, as OpenAI's clients expect."""

    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)
    model: Text
    temperature: float | None = None
    top_p: float | None = None
    top_k: Annotated[int, INT32] | None = None
    seed: Annotated[int, INT64] | None = None
    stop: Any = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension
    min_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None  # vLLM's extension
    # vLLM's extensions on the output's text: special tokens left out (default true), and the
    # stop string that ended it kept (default false)
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # OpenAI's shape: token ids as strings (JSON keys); its size and values are checked with
    # the other sampling limits (router.frontdoor.limits)
    logit_bias: dict[str, float] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    # vLLM's extensions: one of json (a schema), regex, choice; and their older spellings
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | bool | Text | None = None
    guided_regex: Text | None = None
    guided_choice: Annotated[list[Text], Field(min_length=1)] | None = None
    user: Text | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str]:
        stops = [stop] if isinstance(stop, str) else [] if stop is None else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
            raise ValueError("must be a non-empty string or a list of them")
        if len(stops) > MAX_STOP_STRINGS:  # here too: before n copies the request
            raise ValueError(f"holds {len(stops)} stop strings; the limit is {MAX_STOP_STRINGS}")
        return [_utf8(s) for s in stops]

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, bias: dict[str, float] | None) -> dict[str, float] | None:
        for key in bias or {}:
            if not key.isascii() or not key.isdigit() or int(key) > UINT32_MAX:
                raise ValueError(f"keys must be token ids (integers in [0, 2**32) written as "
                                 f"strings), got {SHORT.repr(key)}")
        return bias

    def refuse_unsupported(self) -> None:
        """ValueError naming the first field set to something this server cannot honour."""
        extra = self.model_extra or {}
        for field, neutral in UNSUPPORTED.items():
            value = extra.get(field, neutral)
            if value not in (neutral, None, [], {}):
                raise UnsupportedField(field, f"is not supported here (got {SHORT.repr(value)})")
        constraint = (self.structured_outputs.model_extra or {}) if self.structured_outputs \
            else {}
        for kind in STRUCTURED_UNSUPPORTED:
            if constraint.get(kind) not in (None, "", {}):
                raise UnsupportedField(f"structured_outputs.{kind}", "is not supported here "
                                       "(json, regex, choice and json_object are)")


class UnsupportedField(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


class CompletionRequest(_Request):
    prompt: Any
    echo: bool | None = None
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    logprobs: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None

    @field_validator("prompt")
    @classmethod
    def _prompts(cls, prompt: Any) -> list[str | list[int]]:
        """A batch: every prompt, each a string or a list of token ids (one prompt is a batch
        of one)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                       for p in prompt):
            if len(prompt) > MAX_CHOICES:
                raise ValueError(f"holds {len(prompt)} prompts; the limit is {MAX_CHOICES}")
            prompts = []
            for i, one in enumerate(prompt):
                try:
                    prompts.append(cls._one(one))
                except ValueError as exc:
                    raise ValueError(f"[{i}] {exc}") from None
            return prompts
        return [cls._one(prompt)]

    @staticmethod
    def _one(prompt: Any) -> str | list[int]:
        if isinstance(prompt, str):
            return _utf8(prompt)
        if isinstance(prompt, list) and len(prompt) > MAX_PROMPT_TOKEN_IDS:
            raise ValueError(f"holds {len(prompt)} token ids; the limit is "
                             f"{MAX_PROMPT_TOKEN_IDS}")
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = next((t for t in prompt if not 0 <= t <= UINT32_MAX), None)
            if bad is not None:
                raise ValueError(f"contains {bad}, outside the token ids [0, 2**32)")
            return prompt
        raise ValueError("must be a string or a non-empty list of token ids (ints >= 0)")


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Text
    text: Text | None = None


class FunctionCallName(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Text


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Text
    arguments: Text  # JSON text, as OpenAI sends it


class ToolCallIn(BaseModel):
    """An assistant turn's tool call, sent back in the history."""

    model_config = ConfigDict(strict=True, extra="allow")
    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionDef


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    type: Literal["function"]
    function: FunctionCallName


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    role: Text
    content: Any = None
    name: Text | None = None
    tool_call_id: Text | None = None
    tool_calls: list[ToolCallIn] | None = None

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any) -> str:
        if content is None:
            return ""
        if isinstance(content, str):
            return _utf8(content)
        if isinstance(content, list):  # content parts: text only
            try:
                parts = [TextPart.model_validate(p) for p in content]
            except ValidationError:
                parts = []
            if len(parts) == len(content) and all(p.type == "text" and p.text is not None
                                                  for p in parts):
                return "".join(p.text or "" for p in parts)
            raise ValueError("parts must all be {type: text, text}")
        raise ValueError("must be a string or a list of text parts")


class ChatRequest(_Request):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=0, le=UINT32_MAX)] | None = None
    logprobs: bool | None = None
    # bounded here too, so the error names this API's field (the number is the shared limit)
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: Annotated[list[ToolDef], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # calls are parsed as the model writes them


def describe(error: ValidationError) -> tuple[str, str]:
    """The first error as (field, message), the message starting with the field's name."""
    first = error.errors(include_url=False)[0]
    field = _location(first["loc"])
    return field, f"{field} {_phrase(first)}".strip()


def _location(loc: tuple[Any, ...]) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "body"


KINDS = {"string_type": "a string", "int_type": "an integer", "float_type": "a number",
         "bool_type": "true or false", "list_type": "a list", "dict_type": "an object",
         "model_type": "an object", "model_attributes_type": "an object"}


def _phrase(error: dict[str, Any]) -> str:
    kind, ctx = error["type"], error.get("ctx") or {}
    got = f", got {SHORT.repr(error.get('input'))}"
    if kind == "missing":
        return "is required"
    if kind in KINDS:
        return f"must be {KINDS[kind]}{got}"
    if kind == "greater_than_equal":
        return f"must be >= {ctx['ge']}{got}"
    if kind == "less_than_equal":
        return f"must be <= {ctx['le']}{got}"
    if kind == "too_short":
        return f"must hold at least {ctx.get('min_length', 1)} item(s)"
    if kind == "literal_error":
        return f"must be one of {ctx.get('expected')}{got}"
    if kind == "finite_number":
        return f"must be a finite number{got}"
    if kind == "value_error":
        return str(ctx.get("error", error["msg"]))
    return f"is invalid: {error['msg']}"

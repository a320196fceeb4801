"""A request's limits, one set for both front doors (gRPC and OpenAI HTTP), checked once in
router.frontdoor.validation. The HTTP layer checks only JSON types and what fits the wire's
fields; every
bound a user can hit is here, and its message names the field (in the gRPC API's spelling:
router.frontdoor.openai_codec renames the fields for HTTP clients).

Text is bounded by size before it is tokenized: tokenizing ~1M characters takes ~0.5 s on a CPU
core (and releases the GIL, see engine.tokenizer), so no input can hold the router for long."""

from __future__ import annotations

import json

import jsonschema

from engine.request import SamplingParams, StructuredOutput
from pdserve_proto import pdserve_pb2 as pb

MAX_REQUEST_ID_CHARS = 128
MAX_TEXT_CHARS = 1_000_000  # a prompt, or a chat's contents together, in characters
MAX_TEXT_BYTES = 2 * 1024 * 1024  # the same in UTF-8 bytes (binds for wide characters)
MAX_CHAT_MESSAGES = 4096
MAX_PROMPT_TOKEN_IDS = 1_000_000  # a prompt given as token ids (no model has a longer context)
MAX_STOP_TOKEN_IDS = 4096
# Stop strings: each output token's text is searched for every one, in the worker's step and in
# the router's stream (OpenAI allows 4)
MAX_STOP_STRINGS = 64
MAX_LOGIT_BIAS_TOKENS = 4096
MAX_CHOICES = 256  # completions per HTTP request: prompts in a batch x n
MAX_TOOLS = 128  # functions a chat request may offer
MAX_TEMPERATURE = 2.0  # OpenAI's bound
MAX_LOGPROBS = SamplingParams.MAX_LOGPROBS
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_text(field: str, chars: int, num_bytes: int) -> None:
    """ValueError when a text input (`field`) is over the size limits."""
    if chars > MAX_TEXT_CHARS:
        raise ValueError(f"{field}: {chars} characters; the limit is {MAX_TEXT_CHARS}")
    if num_bytes > MAX_TEXT_BYTES:
        raise ValueError(f"{field}: {num_bytes} bytes of UTF-8; the limit is {MAX_TEXT_BYTES} "
                         f"({MAX_TEXT_BYTES // (1024 * 1024)} MiB)")


def check_chat_size(chat: pb.ChatMessages) -> None:
    """A chat's message count and its texts' size (contents, names, tool calls, tools)."""
    if not chat.messages:
        raise ValueError("chat.messages must hold at least one message")
    if len(chat.messages) > MAX_CHAT_MESSAGES:
        raise ValueError(f"chat.messages holds {len(chat.messages)} messages; the limit is "
                         f"{MAX_CHAT_MESSAGES}")
    texts = [t for m in chat.messages for t in (m.content, m.name, m.tool_call_id)]
    texts += [t for m in chat.messages for c in m.tool_calls for t in (c.name, c.arguments)]
    texts.append(chat.tools_json)
    check_text("chat.messages", sum(len(t) for t in texts), sum(len(t.encode()) for t in texts))


def check_sampling(temperature: float) -> None:
    """The API's bounds beyond what SamplingParams itself requires."""
    if not 0.0 <= temperature <= MAX_TEMPERATURE:  # NaN fails too
        raise ValueError(f"sampling.temperature must be in [0, {MAX_TEMPERATURE:g}], got "
                         f"{temperature:g}")


def check_token_ids(field: str, count: int, limit: int) -> None:
    if count > limit:
        raise ValueError(f"{field} holds {count} token ids; the limit is {limit}")


def check_structured_output(constraint: StructuredOutput) -> None:
    """A constraint's size, and a JSON schema's validity against its meta-schema (what the
    workers' grammar compiler cannot express is refused by them, naming it)."""
    field = f"sampling.structured_output.{constraint.kind}"
    check_text(field, len(constraint.spec), len(constraint.spec.encode()))
    if constraint.kind != "json_schema":
        return
    schema = json.loads(constraint.spec)  # StructuredOutput checked it is JSON
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(p) for p in exc.path) or "the top level"
        raise ValueError(f"{field} is not a valid JSON Schema at {where}: {exc.message}") \
            from None
    except RecursionError:  # the checker recurses per level (objects, or a pattern's groups)
        raise ValueError(f"{field} nests deeper than the router's JSON Schema check can "
                         f"follow (objects or a pattern's groups, ~100 levels)") from None
    except (AttributeError, TypeError) as exc:  # e.g. a "$schema" that is not a string
        raise ValueError(f"{field} is not a valid JSON Schema: {exc}") from None

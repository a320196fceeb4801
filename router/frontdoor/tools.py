"""Tool calling on the chat API (OpenAI's `tools` and `tool_choice`), plain Python.

- `none`: tools are rendered by the chat template, nothing is parsed.
- `required` / a named function: the output is held by structured output (works for any model):
  a named function's output is its arguments (JSON valid against its parameters); `required`'s
  is `{"name": ..., "arguments": {...}}` for one of the tools.
- `auto`: the model decides; calls are parsed from the output in the Hermes/Qwen format
  (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`), which only templates that write
  that format teach a model: `auto` is refused for any other template.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engine.request import StructuredOutput

OPEN, CLOSE = "<tool_call>", "</tool_call>"
HERMES_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*" + re.escape(CLOSE), re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_json(self, index: int | None = None) -> dict:
        body: dict = {"id": self.id, "type": "function",
                      "function": {"name": self.name, "arguments": self.arguments}}
        return body if index is None else {"index": index, **body}


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's tools are used: `mode` none, auto, required or named (`name`)."""

    mode: str
    name: str = ""

    def calls(self, text: str) -> tuple[str, list[ToolCall]]:
        """The output as (content, tool calls)."""
        if self.mode == "named":
            return "", [ToolCall(self.name, _compact(text))]
        if self.mode == "required":
            try:
                call = json.loads(text)
            except json.JSONDecodeError:  # cut short by max_tokens: no whole call
                return text, []
            return "", [ToolCall(call["name"], json.dumps(call["arguments"]))]
        if self.mode == "auto":
            return hermes_calls(text)
        return text, []


def plan(tools: list[dict], tool_choice: str | dict | None, template_knows_calls: bool
         ) -> tuple[ToolPlan, StructuredOutput | None]:
    """The plan and the output constraint it needs; ValueError naming what is wrong."""
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or \
                not isinstance(function.get("parameters", {}) or {}, dict):
            raise ValueError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": "
                             f"{{\"name\": str, \"parameters\": object}}}}")
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if isinstance(tool_choice, dict):
        name = tool_choice["function"]["name"]
        if name not in names:
            raise ValueError(f"tool_choice names {name!r}, which is not in tools "
                             f"({', '.join(names) or 'none given'})")
        parameters = next(t["function"].get("parameters") for t in tools
                          if t["function"]["name"] == name)
        return ToolPlan("named", name), StructuredOutput("json_schema",
                                                         json.dumps(_object(parameters)))
    if tool_choice != "none" and not tools:
        raise ValueError(f"tool_choice {tool_choice!r} needs tools")
    if tool_choice == "required":
        return ToolPlan("required"), StructuredOutput("json_schema", json.dumps(
            {"anyOf": [_call_schema(t["function"]) for t in tools]}))
    if tool_choice == "auto" and not template_knows_calls:
        raise ValueError("tool_choice 'auto' needs a chat template that teaches the model a "
                         "tool-call format this server parses (Hermes/Qwen <tool_call>); this "
                         "model's does not: use 'required' or name a function")
    return ToolPlan(tool_choice), None


def hermes_calls(text: str) -> tuple[str, list[ToolCall]]:
    """Content and calls of an output in the Hermes/Qwen format. A block that is not a JSON
    call stays in the content."""
    calls: list[ToolCall] = []
    content = text
    for match in HERMES_CALL.finditer(text):
        try:
            call = json.loads(match.group(1))
            calls.append(ToolCall(call["name"], json.dumps(call.get("arguments", {}))))
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        content = content.replace(match.group(0), "", 1)
    return (content.strip() if calls else content), calls


def _object(parameters: dict | None) -> dict:
    return parameters if parameters else {"type": "object", "properties": {}}


def _call_schema(function: dict) -> dict:
    return {"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
            "properties": {"name": {"const": function["name"]},
                           "arguments": _object(function.get("parameters"))}}


def _compact(text: str) -> str:
    try:
        return json.dumps(json.loads(text))
    except json.JSONDecodeError:
        return text  # cut short by max_tokens: the client sees what there is

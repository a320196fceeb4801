"""Tool calls streamed as OpenAI streams them: a call's first delta carries its index, id and
name, and later deltas carry fragments of its arguments' JSON text, as the model writes them.
Plain Python.

- a named function (`named`): the output *is* the arguments; it streams from the first token;
- `required`: the output is `{"name": ..., "arguments": {...}}`; once the name is known the
  arguments stream, the object's closing brace held back until the end;
- `auto` (Hermes/Qwen): text is content until `<tool_call>`; each block after it is a call like
  `required`'s, up to `</tool_call>`; a block that turns out not to be a call is content.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from router.frontdoor.tools import CLOSE, OPEN, ToolPlan

# The start of a call object up to its arguments' value (the name first, as xgrammar writes the
# schema's properties in order and Hermes templates show them).
CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def _json_string(raw: str) -> str | None:
    """A JSON string's body (between its quotes) as text; None where it is no valid JSON (a
    bad escape, a raw control character): such a block is content, not a call."""
    try:
        return json.loads(f'"{raw}"')
    except json.JSONDecodeError:
        return None


@dataclass
class CallDelta:
    index: int
    arguments: str = ""
    name: str = ""  # on a call's first delta, with its id
    id: str = ""

    def as_json(self) -> dict:
        if not self.id:
            return {"index": self.index, "function": {"arguments": self.arguments}}
        return {"index": self.index, "id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class CallStream:
    """One call object's text as it streams (`{"name": ..., "arguments": ...}`)."""

    index: int
    text: str = ""
    start: int | None = None  # where the arguments' text begins, once the head is whole
    sent: int = 0  # of the arguments' text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def feed(self, text: str) -> list[CallDelta]:
        self.text += text
        deltas = []
        if self.start is None:
            head = CALL_HEAD.match(self.text)
            name = None if head is None else _json_string(head.group(1))
            if name is None:  # not (yet) a call's head
                return []
            self.start = head.end()
            deltas.append(CallDelta(self.index, "", name, self.id))
        body = self.text[self.start:]
        end = value_end(body)
        if end is None and not body.lstrip().startswith(("{", "[")):
            held = body.rstrip()  # not an object: the call's closing brace may end it
            end = len(held[:-1].rstrip()) if held.endswith("}") else len(body)
        return deltas + self._send(body, len(body) if end is None else end)

    def finish(self) -> list[CallDelta] | None:
        """The rest of the arguments; None when the text never was a call."""
        if self.start is None:
            return None
        body = self.text[self.start:]
        end = value_end(body)
        if end is None:  # cut short, or not an object: all there is, less the call's brace
            body = body.rstrip()
            end = len(body) - 1 if body.endswith("}") and body.lstrip()[:1] not in "{[" \
                else len(body)
        return self._send(body, end)

    def _send(self, body: str, upto: int) -> list[CallDelta]:
        if upto <= self.sent:
            return []
        piece, self.sent = body[self.sent:upto], upto
        return [CallDelta(self.index, piece)]


class ToolStream:
    """A streamed chat output under a tool plan: `feed` its text, get (content, call deltas)."""

    def __init__(self, plan: ToolPlan):
        self.plan = plan
        self.calls = 0  # calls begun
        self._buffer = ""
        self._call: CallStream | None = None
        self._named_id = f"call_{uuid.uuid4().hex[:24]}"

    def feed(self, text: str) -> tuple[str, list[CallDelta]]:
        mode = self.plan.mode
        if mode == "named":
            first = [] if self.calls else [CallDelta(0, "", self.plan.name, self._named_id)]
            self.calls = 1
            return "", first + ([CallDelta(0, text)] if text else [])
        if mode == "required":
            self._call = self._call or CallStream(0)
            self.calls = 1
            return "", self._call.feed(text)
        return self._auto(text) if mode == "auto" else (text, [])

    def finish(self) -> tuple[str, list[CallDelta]]:
        """At the end of the output: content still held, and the calls' last deltas."""
        mode = self.plan.mode
        if mode == "named":  # no text at all still makes its call
            return "", [] if self.calls else [CallDelta(0, "", self.plan.name, self._named_id)]
        if self._call is None:
            return self._buffer, []
        call, self._call = self._call, None
        if mode == "required":
            ended = call.finish()
            if ended is not None:
                return "", ended
            content, calls = self.plan.calls(call.text)  # its name did not come first
            return content, [CallDelta(0, c.arguments, c.name, c.id) for c in calls]
        deltas = call.feed(self._buffer)  # auto: an unclosed call takes what is held
        ended = call.finish()
        if ended is None:  # not a call after all
            self.calls -= 1
            return OPEN + call.text, []
        return "", deltas + ended

    def _auto(self, text: str) -> tuple[str, list[CallDelta]]:
        self._buffer += text
        content, deltas = "", []
        while True:
            tag = OPEN if self._call is None else CLOSE
            at = self._buffer.find(tag)
            if at < 0:
                keep = _partial_tag(self._buffer, tag)
                ready, self._buffer = self._buffer[:len(self._buffer) - keep], \
                    self._buffer[len(self._buffer) - keep:]
                if self._call is None:
                    content += ready
                else:
                    deltas += self._call.feed(ready)
                break
            ready, self._buffer = self._buffer[:at], self._buffer[at + len(tag):]
            if self._call is None:
                content += ready
                self._call = CallStream(self.calls)
                self.calls += 1
                continue
            deltas += self._call.feed(ready)
            ended = self._call.finish()
            if ended is None:  # not a call after all: its block is content
                content += OPEN + self._call.text + CLOSE
                self.calls -= 1
            deltas += ended or []
            self._call = None
        return (content if not (self.calls and not content.strip()) else ""), deltas


def value_end(text: str) -> int | None:
    """Where the JSON object or array `text` starts with ends (after its closing bracket), or
    None while it is open (or it is not one): what comes after belongs to the call, not to its
    arguments."""
    depth, in_string, escaped = 0, False, False
    for i, char in enumerate(text):
        if in_string:
            escaped, in_string = (False, True) if escaped else (char == "\\", char != '"')
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
        elif depth == 0 and not char.isspace():
            return None  # a scalar value
    return None


def merge(deltas: list[CallDelta]) -> list[CallDelta]:
    """Adjacent deltas of one call as one (a chunk carries each call once)."""
    merged: list[CallDelta] = []
    for delta in deltas:
        if merged and merged[-1].index == delta.index and not delta.id:
            merged[-1].arguments += delta.arguments
        else:
            merged.append(CallDelta(delta.index, delta.arguments, delta.name, delta.id))
    return merged


def _partial_tag(text: str, tag: str) -> int:
    """How many characters at the end of `text` may begin `tag`."""
    return next((k for k in range(min(len(tag) - 1, len(text)), 0, -1)
                 if tag.startswith(text[-k:])), 0)

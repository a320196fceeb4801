"""Tool calling's plain parts (router.frontdoor.tools): the plan and constraint each tool_choice
gets, and tool calls parsed from whole and streamed outputs."""

from __future__ import annotations

import json

import pytest

from router.frontdoor.tool_stream import CallDelta, ToolStream, merge
from router.frontdoor.tools import ToolPlan, hermes_calls, plan

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}


def test_each_tool_choice_gets_its_plan_and_constraint():
    named, constraint = plan([WEATHER, TIME], {"type": "function",
                                               "function": {"name": "get_weather"}}, False)
    assert named == ToolPlan("named", "get_weather")
    assert json.loads(constraint.spec) == WEATHER["function"]["parameters"]
    required, constraint = plan([WEATHER, TIME], "required", False)
    options = json.loads(constraint.spec)["anyOf"]
    assert [o["properties"]["name"]["const"] for o in options] == ["get_weather", "get_time"]
    assert options[1]["properties"]["arguments"] == {"type": "object", "properties": {}}
    assert plan([WEATHER], "none", False) == (ToolPlan("none"), None)
    assert plan([WEATHER], None, True) == (ToolPlan("auto"), None)  # tools given: auto


@pytest.mark.parametrize("tools, choice, words", [
    ([WEATHER], {"type": "function", "function": {"name": "nope"}}, "names 'nope'"),
    ([], "required", "tool_choice 'required' needs tools"),
    ([WEATHER], "auto", "needs a chat template"),
])
def test_refusals_name_the_problem(tools, choice, words):
    with pytest.raises(ValueError, match=words):
        plan(tools, choice, False)


def test_a_tool_without_a_function_name_is_refused_not_a_crash():
    for tools in ([{"type": "function"}], [{"type": "function", "function": {"name": 3}}],
                  ["get_weather"]):
        with pytest.raises(ValueError, match=r"tools\[0\] must be"):
            plan(tools, "required", False)


def test_calls_from_a_whole_output():
    assert ToolPlan("named", "get_weather").calls('{"city": "Paris"}')[1][0].arguments == \
        '{"city": "Paris"}'
    content, calls = ToolPlan("required").calls(
        '{"name": "get_time", "arguments": {}}')
    assert content == "" and (calls[0].name, calls[0].arguments) == ("get_time", "{}")
    assert ToolPlan("required").calls('{"name": "get_ti')[1] == []  # cut short: no call
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' \
           '\n</tool_call>'
    content, calls = hermes_calls(text)
    assert content == "Let me look." and calls[0].name == "get_weather"
    assert json.loads(calls[0].arguments) == {"city": "Oslo"}
    assert hermes_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])


def stream_all(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[CallDelta], int]:
    """Feed a streamed output piece by piece: its content, its call deltas, and how many
    deltas came before the end."""
    stream = ToolStream(plan)
    content, deltas = "", []
    for piece in pieces:
        text, got = stream.feed(piece)
        content, deltas = content + text, deltas + got
    before = len(deltas)
    text, got = stream.finish()
    return content + text, deltas + got, before


def calls_of(deltas: list[CallDelta]) -> list[tuple[str, str]]:
    """(name, arguments) per call, as a client adds its deltas up."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        if d.id:
            assert d.index not in calls, "a call announced twice"
            calls[d.index] = [d.name, ""]
        calls[d.index][1] += d.arguments
    return [tuple(calls[k]) for k in sorted(calls)]


def test_a_named_call_streams_its_arguments_as_they_come():
    pieces = ['{"ci', 'ty": "Pa', 'ris"}']
    content, deltas, before = stream_all(ToolPlan("named", "get_weather"), pieces)
    assert content == "" and deltas[0].id and deltas[0].name == "get_weather"
    assert calls_of(deltas) == [("get_weather", '{"city": "Paris"}')]
    assert before == len(deltas) == 4  # the header, then one fragment per piece
    assert calls_of(stream_all(ToolPlan("named", "f"), [])[1]) == [("f", "")]


def test_a_required_call_streams_its_arguments_once_its_name_is_known():
    pieces = ['{"na', 'me": "get_w', 'eather", "argu', 'ments": {"city"', ': "Oslo"', '}', ' }']
    content, deltas, before = stream_all(ToolPlan("required"), pieces)
    assert content == "" and calls_of(deltas) == [("get_weather", '{"city": "Oslo"}')]
    assert before >= 3  # arguments went out before the end
    stream = ToolStream(ToolPlan("required"))
    sent = "".join(d.arguments for p in pieces[:6] for d in stream.feed(p)[1])
    assert sent == '{"city": "Oslo"}'  # its object closed: sent at once (the call's brace never)
    # the arguments first: nothing streams, the whole call comes at the end
    _, late, before = stream_all(ToolPlan("required"), ['{"arguments": {}, ', '"name": "t"}'])
    assert before == 0 and calls_of(late) == [("t", "{}")]


def test_auto_streams_content_then_each_call_and_keeps_a_bad_block_as_content():
    pieces = ["Sure", ", <tool", "_ca", 'll>{"name": "get_time", ', '"arguments": {}}</tool_',
              'call>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Lima"}}',
              "</tool_call>"]
    content, deltas, _ = stream_all(ToolPlan("auto"), pieces)
    assert content == "Sure, "
    assert calls_of(deltas) == [("get_time", "{}"), ("get_weather", '{"city": "Lima"}')]
    assert [d.index for d in deltas if d.id] == [0, 1]
    content, deltas, _ = stream_all(ToolPlan("auto"), ["a < b <", "x <tool_call>not json",
                                                        "</tool_call> done"])
    assert content == "a < b <x <tool_call>not json</tool_call> done" and deltas == []
    content, deltas, _ = stream_all(ToolPlan("auto"), ['<tool_call>{"name": "f", "arguments": {',
                                                       '"a": 1}}'])  # cut short: no close tag
    assert content == "" and calls_of(deltas) == [("f", '{"a": 1}')]
    for name in ('a\\q', 'a\nb'):  # a bad escape, a raw newline: not JSON, so content
        block = '<tool_call>{"name": "' + name + '", "arguments": {}}</tool_call>'
        content, deltas, _ = stream_all(ToolPlan("auto"), [block[:20], block[20:]])
        assert content == block and deltas == []
        assert hermes_calls(block) == (block, [])  # as the whole output's reading


def test_adjacent_deltas_of_a_call_go_out_as_one():
    deltas = [CallDelta(0, "", "f", "call_1"), CallDelta(0, '{"a"'), CallDelta(0, ": 1}"),
              CallDelta(1, "", "g", "call_2")]
    assert [d.as_json() for d in merge(deltas)] == [
        {"index": 0, "id": "call_1", "type": "function",
         "function": {"name": "f", "arguments": '{"a": 1}'}},
        {"index": 1, "id": "call_2", "type": "function", "function": {"name": "g",
                                                                       "arguments": ""}}]


HERMES_TEMPLATE = """{% if tools %}<|im_start|>system
You may call: {% for t in tools %}{{ t.function.name }} {% endfor %}
Reply with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<tool_call>{{ c.function | tojson }}</tool_call>\
{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


def test_a_template_that_writes_tool_calls_renders_tools_and_the_calls_made(tmp_path,
                                                                            default_model_dir):
    from engine.config import ModelConfig
    from engine.tokenizer import Tokenizer
    from pdserve_proto import pdserve_pb2 as pb
    from router.frontdoor.validation import Frontend

    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        (tmp_path / name).write_bytes((default_model_dir / name).read_bytes())
    (tmp_path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.knows_tool_calls and not Tokenizer(default_model_dir).knows_tool_calls
    frontend = Frontend(tokenizer, ModelConfig.from_dir(tmp_path), "m")
    chat = pb.ChatMessages(tools_json=json.dumps([WEATHER, TIME]), messages=[
        pb.ChatMessage(role="user", content="Weather in Oslo?"),
        pb.ChatMessage(role="assistant", tool_calls=[pb.ToolCall(
            id="call_1", name="get_weather", arguments='{"city": "Oslo"}')]),
        pb.ChatMessage(role="tool", tool_call_id="call_1", content="rain")])
    job = frontend.parse(pb.GenerateRequest(chat=chat), 0.0)
    text = tokenizer.decode(job.token_ids, skip_special_tokens=False)
    assert "You may call: get_weather get_time" in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert text.endswith("<|im_start|>assistant\n")


def test_the_arguments_end_where_their_object_does():
    """Keys after the arguments, braces inside strings and a partial close tag held at the end
    are not arguments; a block that never was a call makes no finish_reason tool_calls."""
    pieces = ['<tool_call>{"name": "f", "arguments": {"s": "}{\\"x"', ', "n": [1, {"a": 2}]}',
              ', "x": 2}</tool_call>']
    content, deltas, _ = stream_all(ToolPlan("auto"), pieces)
    args = calls_of(deltas)[0][1]
    assert json.loads(args) == {"s": '}{"x', "n": [1, {"a": 2}]} and content == ""
    _, cut, _ = stream_all(ToolPlan("auto"), ['<tool_call>{"name": "f", "arguments": {"a": 1}}',
                                              "</tool_c"])  # the output ends mid-tag
    assert calls_of(cut) == [("f", '{"a": 1}')]
    stream = ToolStream(ToolPlan("auto"))
    stream.feed("<tool_call>not a call")
    assert stream.finish() == ("<tool_call>not a call", []) and stream.calls == 0

"""Tool calling's plain parts (router.frontdoor.tools): the plan and constraint each tool_choice
gets, and tool calls parsed from whole and streamed outputs."""

from __future__ import annotations

import json

import pytest

from router.frontdoor.tools import AutoStream, ToolPlan, hermes_calls, plan

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


def test_a_streamed_auto_output_holds_back_only_what_may_be_a_call():
    stream = AutoStream()
    sent = [stream.feed(t) for t in ("Sure", ", <tool", "_ca", 'll>{"name": "get_time", ',
                                     '"arguments": {}}</tool_call>')]
    assert "".join(sent) == "Sure, "
    content, calls = stream.finish()
    assert content == "" and calls[0].name == "get_time"
    plain = AutoStream()
    assert plain.feed("a < b") == "a < b" and plain.feed(" <") == " " and plain.feed("x") == "<x"
    assert plain.finish() == ("", [])


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

"""OpenAI request bodies -> the router's GenerateRequest, and its responses -> OpenAI JSON,
without a cluster: every refusal names its field and limit."""

from __future__ import annotations

import json

import grpc
import pytest

from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.openai_codec import ApiError, logprobs_json, parse, timings, usage

MODEL = "tiny"


def refused(body: dict, chat: bool = False) -> ApiError:
    with pytest.raises(ApiError) as caught:
        parse(body, chat, MODEL)
    return caught.value


def test_a_completion_maps_every_sampling_field():
    api = parse({"model": MODEL, "prompt": "hi", "max_tokens": 5, "temperature": 0.5,
                 "top_p": 0.9, "top_k": 40, "seed": 7, "stop": "\n", "logprobs": 2,
                 "stop_token_ids": [3], "ignore_eos": True, "user": "u1"}, False, MODEL)
    s = api.request.sampling
    assert api.request.prompt == "hi" and api.request.model == MODEL
    assert (s.max_tokens, s.temperature, round(s.top_p, 3), s.top_k, s.seed) == \
        (5, 0.5, 0.9, 40, 7)
    assert list(s.stop) == ["\n"] and list(s.stop_token_ids) == [3] and s.ignore_eos
    assert s.logprobs == 2 and api.logprobs == 2 and not api.stream
    assert api.request.request_id.startswith("cmpl-")


def test_defaults_follow_openai():
    api = parse({"model": MODEL, "prompt": [1, 2, 3]}, False, MODEL)
    s = api.request.sampling
    assert list(api.request.prompt_token_ids.ids) == [1, 2, 3]
    assert s.max_tokens == 16 and s.temperature == 1.0 and s.top_k == -1
    assert not s.HasField("top_p")  # absent: 1.0 (disabled), as the router reads it
    assert not s.HasField("seed") and not s.HasField("logprobs") and api.logprobs is None
    chat = parse({"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, True, MODEL)
    assert not chat.max_tokens_given and not chat.request.sampling.HasField("max_tokens")
    assert chat.request.request_id.startswith("chatcmpl-")


def test_penalties_logit_bias_and_min_tokens_reach_the_grpc_options():
    s = parse({"model": MODEL, "prompt": "x", "presence_penalty": 0.5, "frequency_penalty": -1,
               "repetition_penalty": 1.25, "min_tokens": 3, "logit_bias": {"7": -100, "12": 2.5}},
              False, MODEL).request.sampling
    assert (s.presence_penalty, s.frequency_penalty, s.min_tokens) == (0.5, -1.0, 3)
    assert s.HasField("repetition_penalty") and s.repetition_penalty == 1.25
    assert dict(s.logit_bias) == {7: -100.0, 12: 2.5}
    off = parse({"model": MODEL, "prompt": "x", "presence_penalty": None, "logit_bias": None},
                False, MODEL).request.sampling
    assert not off.HasField("repetition_penalty") and not off.logit_bias
    assert (off.presence_penalty, off.frequency_penalty, off.min_tokens) == (0, 0, 0)


def test_vllms_text_options_reach_the_grpc_options():
    s = parse({"model": MODEL, "prompt": "x", "skip_special_tokens": False,
               "include_stop_str_in_output": True, "spaces_between_special_tokens": True},
              False, MODEL).request.sampling
    assert s.HasField("skip_special_tokens") and not s.skip_special_tokens
    assert s.include_stop_str_in_output
    plain = parse({"model": MODEL, "prompt": "x"}, False, MODEL).request.sampling
    assert not plain.HasField("skip_special_tokens") and not plain.include_stop_str_in_output


def test_echo_asks_the_workers_for_prompt_logprobs_only_with_logprobs():
    scored = parse({"model": MODEL, "prompt": [5, 6, 7], "echo": True, "logprobs": 1,
                    "max_tokens": 1}, False, MODEL)
    assert scored.echo and scored.request.sampling.prompt_logprobs == 1
    text_only = parse({"model": MODEL, "prompt": "x", "echo": True}, False, MODEL)
    assert text_only.echo and not text_only.request.sampling.HasField("prompt_logprobs")
    assert not parse({"model": MODEL, "prompt": "x"}, False, MODEL).echo


def test_response_formats_and_vllms_constraints_become_one_grpc_constraint():
    def constraint(**body: object) -> object:
        request = parse({"model": MODEL, "prompt": "x", **body}, False, MODEL).request
        s = request.sampling
        return s.structured_output if s.HasField("structured_output") else None

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert constraint(response_format={"type": "text"}) is None
    assert constraint(response_format={"type": "json_object"}).json_object
    got = constraint(response_format={"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}})
    assert json.loads(got.json_schema) == schema
    assert json.loads(constraint(structured_outputs={"json": schema}).json_schema) == schema
    assert constraint(structured_outputs={"regex": "[0-9]+"}).regex == "[0-9]+"
    assert list(constraint(guided_choice=["a", "b"]).choice.choices) == ["a", "b"]
    assert json.loads(constraint(guided_json=json.dumps(schema)).json_schema) == schema


@pytest.mark.parametrize("body, param, words", [
    ({"response_format": {"type": "xml"}}, "response_format.type",
     "must be one of 'text', 'json_object' or 'json_schema'"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema",
     "is required for type json_schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
     "response_format.json_schema.schema", "is required"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_*",
     "a second output constraint"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "at least 1"),
])
def test_bad_output_constraints_name_the_field(body, param, words):
    error = refused({"model": MODEL, "prompt": "x", **body})
    assert error.status == 400 and error.param == param and words in error.message, error.message


def test_chat_messages_text_parts_logprobs_and_stream_options():
    api = parse({"model": MODEL, "stream": True, "stream_options": {"include_usage": True},
                 "messages": [{"role": "system", "content": "be brief"},
                              {"role": "user", "content": [{"type": "text", "text": "a"},
                                                           {"type": "text", "text": "b"}]}],
                 "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 9}, True, MODEL)
    assert [(m.role, m.content) for m in api.request.chat.messages] == [
        ("system", "be brief"), ("user", "ab")]
    assert api.stream and api.include_usage and api.logprobs == 3
    assert api.request.sampling.max_tokens == 9 and api.max_tokens_given


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x"}, "model", "is required"),
    ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens", ">= 0, got -1"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, "temperature", "a number"),
    ({"model": MODEL, "prompt": "x", "top_p": float("nan")}, "top_p", "finite number"),
    ({"model": MODEL, "prompt": "x", "logprobs": -1}, "logprobs", ">= 0, got -1"),
    ({"model": MODEL, "prompt": "x", "n": 0}, "n", ">= 1, got 0"),
    ({"model": MODEL, "prompt": ["a"] * 100, "n": 3}, "n", "= 300 choices; the limit is 256"),
    ({"model": MODEL, "prompt": ["a", [1, -2]]}, "prompt", "[1] contains -2"),
    ({"model": MODEL, "prompt": "x", "echo": "yes"}, "echo", "true or false"),
    ({"model": MODEL, "prompt": "x", "best_of": 2}, "best_of", "not supported"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"-5": 1}}, "logit_bias",
     "keys must be token ids"),
    ({"model": MODEL, "prompt": "x", "logit_bias": {"5": "up"}}, "logit_bias.5", "a number"),
    ({"model": MODEL, "prompt": "x", "min_tokens": -1}, "min_tokens", ">= 0, got -1"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": float("inf")}, "presence_penalty",
     "finite number"),
    ({"model": MODEL, "prompt": [1, -2]}, "prompt", "outside the token ids [0, 2**32)"),
    ({"model": MODEL, "prompt": [[["x"]]]}, "prompt", "must be a string or a non-empty list"),
    ({"model": MODEL, "prompt": [2**32]}, "prompt", "4294967296, outside the token ids"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [2**33]}, "stop_token_ids[0]",
     "<= 4294967295, got 8589934592"),
    ({"model": MODEL, "prompt": "x", "top_k": 2**40}, "top_k", "<= 2147483647"),
    ({"model": MODEL, "prompt": "x", "seed": 2**63}, "seed", "<= 9223372036854775807"),
    ({"model": MODEL, "prompt": [1] * 1_000_001}, "prompt", "the limit is 1000000"),
    ({"model": MODEL, "prompt": "x", "stop_token_ids": [1] * 4097}, "stop_token_ids",
     "at most 4096"),
    ({"model": MODEL, "prompt": "x", "echo": ["a" * 10_000] * 1000}, "echo", "got ["),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, "stop", "non-empty string"),
    ({"model": MODEL, "prompt": "\ud800"}, "prompt", "not valid UTF-8 text"),
    ({"model": MODEL, "prompt": "x", "stop": "a\udfff"}, "stop", "not valid UTF-8 text"),
    ({"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
     "stream_options", "only allowed with stream: true"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"model": MODEL, "prompt": "x", "skip_special_tokens": 1}, "skip_special_tokens",
     "true or false"),
    ({"model": MODEL, "prompt": "x", "spaces_between_special_tokens": False},
     "spaces_between_special_tokens", "not supported"),
    ({"model": MODEL, "prompt": "x", "min_p": 0.05}, "min_p", "not supported"),
    ({"model": MODEL, "prompt": "x", "structured_outputs": {"grammar": "root ::= [a]"}},
     "structured_outputs.grammar", "not supported"),
    ({"model": MODEL, "prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
     "chat_template_kwargs", "not supported"),
    ({"model": MODEL, "prompt": "x", "stop": ["a"] * 65}, "stop",
     "holds 65 stop strings; the limit is 64"),
    # what n would copy is refused before it is copied
    ({"model": MODEL, "prompt": "x" * 1_000_001, "n": 2}, "prompt",
     "1000001 characters; the limit is 1000000"),
])
def test_bad_fields_are_400_naming_the_field_and_its_limit(body, param, words):
    error = refused(body)
    assert error.status == 400 and error.param == param and words in error.message
    assert error.message.startswith(param)
    assert error.body()["error"]["type"] == "invalid_request_error"


def test_chat_refusals_and_an_unknown_model():
    assert refused({"model": MODEL, "messages": []}, chat=True).param == "messages"
    error = refused({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                     "tools": [], "tool_choice": "required"}, chat=True)
    assert (error.param, error.message) == ("tool_choice", "tool_choice 'required' needs tools")
    many = [{"role": "user", "content": "x"}] * 4097
    error = refused({"model": MODEL, "messages": many, "n": 2}, chat=True)  # before n copies it
    assert error.param == "messages" and "4097 messages; the limit is 4096" in error.message
    error = refused({"model": MODEL, "messages": [{"role": "user", "content": 3}]}, chat=True)
    assert error.param == "messages[0].content"
    error = refused({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                     "top_logprobs": 2}, chat=True)
    assert error.param == "top_logprobs" and "needs logprobs: true" in error.message
    missing = refused({"model": "gpt-4", "prompt": "x"})
    assert missing.status == 404 and missing.code == "model_not_found"
    assert refused([1, 2]).message == "the request body must be a JSON object"
    error = refused({"model": MODEL, "messages": [{"role": "user", "content": "\ud800x"}]},
                    chat=True)
    assert error.param == "messages[0].content" and "not valid UTF-8" in error.message
    error = refused({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                     "logprobs": True, "top_logprobs": 21}, chat=True)
    assert error.param == "top_logprobs" and "<= 20, got 21" in error.message
    assert parse({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                  "tool_choice": "none"}, True, MODEL).request.chat.messages  # no tools: fine


def test_top_p_zero_negative_seeds_and_continuous_usage():
    api = parse({"model": MODEL, "prompt": "x", "top_p": 0, "seed": -1, "stream": True,
                 "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
                False, MODEL)
    s = api.request.sampling
    assert s.HasField("top_p") and s.top_p == 0.0  # the router reads 0 as greedy
    assert s.seed == 2**64 - 1  # int64 -> uint64 one to one: -1 differs from every seed >= 0
    assert parse({"model": MODEL, "prompt": "x", "seed": -(2**63)}, False,
                 MODEL).request.sampling.seed == 2**63
    assert api.include_usage and api.continuous_usage
    plain = parse({"model": MODEL, "prompt": "x", "stream": True,
                   "stream_options": {"continuous_usage_stats": True}}, False, MODEL)
    assert not plain.continuous_usage  # as vLLM: only with include_usage


def test_developer_and_tool_roles_reach_the_router():
    api = parse({"model": MODEL, "messages": [
        {"role": "developer", "content": "be brief"}, {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": "4", "tool_call_id": "call_1", "name": "add"}]}, True, MODEL)
    turns = [(m.role, m.content, m.tool_call_id, m.name) for m in api.request.chat.messages]
    assert turns == [("developer", "be brief", "", ""), ("user", "2+2?", "", ""),
                     ("assistant", "", "", ""), ("tool", "4", "call_1", "add")]


def test_router_statuses_map_to_http_codes_with_this_apis_field_names():
    cases = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
             grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
             grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.INTERNAL: 500}
    for code, status in cases.items():
        assert ApiError.from_status(code, "m").status == status
    error = ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT,
                                 "sampling.top_k must be -1, 0 or >= 1, got -5")
    assert error.message == "top_k must be -1, 0 or >= 1, got -5" and error.param == "top_k"
    error = ApiError.from_status(grpc.StatusCode.INVALID_ARGUMENT,
                                 "prompt_token_ids contains 99999, outside the vocabulary")
    assert error.message.startswith("prompt contains 99999")


def response() -> pb.GenerateResponse:
    return pb.GenerateResponse(
        usage=pb.Usage(prompt_tokens=10, completion_tokens=4, cached_tokens=8),
        timings=pb.Timings(ttft_s=0.5, e2e_s=1.0, router_queue_s=0.1, prefill_queue_s=0.05,
                           prefill_compute_s=0.3, kv_transfer_s=0.01, kv_transfer_bytes=100,
                           kv_transport="shared", decode_admission_s=0.02,
                           prefill_site="remote"))


def test_usage_reports_cached_tokens_and_timings_the_breakdown():
    assert usage(response().usage) == {"prompt_tokens": 10, "completion_tokens": 4,
                                 "total_tokens": 14,
                                 "prompt_tokens_details": {"cached_tokens": 8}}
    t = timings(response())
    assert t["router_queue_s"] == pytest.approx(0.1) and t["kv_transport"] == "shared"
    assert t["decode_admission_s"] == pytest.approx(0.02) and t["prefill_site"] == "remote"


def test_logprobs_take_the_k_most_likely_with_the_sampled_token_among_them():
    items = [pb.TokenLogprob(token_id=5, logprob=-0.1, top={6: -2.0, 7: -3.0}),
             pb.TokenLogprob(token_id=8, logprob=-4.0, top={9: -0.5, 6: -1.0})]
    text = {5: "a", 6: "b", 7: "c", 8: "dd", 9: "e"}.__getitem__
    completion = parse({"model": MODEL, "prompt": "x", "logprobs": 2}, False, MODEL)
    out = logprobs_json(completion, items, text, offset=3)
    assert out["tokens"] == ["a", "dd"] and out["token_logprobs"] == [
        pytest.approx(-0.1), pytest.approx(-4.0)]
    assert out["top_logprobs"] == [{"a": pytest.approx(-0.1), "b": -2.0},
                                   {"e": -0.5, "b": -1.0}]
    assert out["text_offset"] == [3, 4]
    chat = parse({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                  "logprobs": True, "top_logprobs": 1}, True, MODEL)
    content = logprobs_json(chat, items, text)["content"]
    assert content[1]["token"] == "dd" and content[1]["bytes"] == [100, 100]
    assert [t["token"] for t in content[1]["top_logprobs"]] == ["e"]
    assert logprobs_json(parse({"model": MODEL, "prompt": "x"}, False, MODEL), items,
                         text) is None

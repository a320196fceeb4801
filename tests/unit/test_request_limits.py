"""One set of request limits for both front doors (router.frontdoor.limits, checked in the
Frontend): the
gRPC request an HTTP body becomes is held to exactly what a gRPC client's is. Tokenizer and
config of the default model; no workers."""

from __future__ import annotations

import json

import grpc
import pytest

from common.grpc_server import NO_DEADLINE_S, call_budget_s
from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.limits import (
    MAX_CHAT_MESSAGES,
    MAX_PROMPT_TOKEN_IDS,
    MAX_TEXT_BYTES,
    MAX_TEXT_CHARS,
)
from router.frontdoor.openai_codec import parse
from router.frontdoor.validation import Frontend
from router.request.calls import CallScope

MODEL = "m"


@pytest.fixture(scope="module")
def frontend(default_model_dir) -> Frontend:
    return Frontend(Tokenizer(default_model_dir), ModelConfig.from_dir(default_model_dir), MODEL)


def grpc_request(**sampling: object) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt="hello", sampling=pb.SamplingOptions(**sampling))


def refusal(frontend: Frontend, request: pb.GenerateRequest) -> str:
    with pytest.raises(ValueError) as caught:
        frontend.parse(request, 0.0)
    return str(caught.value)


@pytest.mark.parametrize("sampling, words", [
    ({"temperature": 9.0}, "sampling.temperature must be in [0, 2], got 9"),
    ({"top_p": -0.5}, "sampling.top_p must be in [0, 1], got -0.5"),
    ({"top_p": 1.5}, "sampling.top_p must be in [0, 1], got 1.5"),
    ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
    ({"logprobs": 21}, "sampling.logprobs must be in [0, 20], got 21"),
    ({"stop_token_ids": [2**31]}, "sampling.stop_token_ids contains 2147483648, outside the "
                                  "vocabulary"),
])
def test_grpc_and_http_share_the_limits(frontend, sampling, words):
    assert words in refusal(frontend, grpc_request(**sampling))
    body = {"model": MODEL, "prompt": "hello", **sampling}
    if "max_tokens" not in sampling:
        body["max_tokens"] = 16
    assert words in refusal(frontend, parse(body, False, MODEL).request)


@pytest.mark.parametrize("sampling, words", [
    ({"presence_penalty": 3.0}, "sampling.presence_penalty must be in [-2, 2], got 3"),
    ({"frequency_penalty": -2.5}, "sampling.frequency_penalty must be in [-2, 2], got -2.5"),
    ({"repetition_penalty": 0.0}, "sampling.repetition_penalty must be in (0, 2], got 0"),
    ({"min_tokens": 17}, "sampling.min_tokens must be in [0, max_tokens=16], got 17"),
    ({"logit_bias": {49152: 1.0}}, "sampling.logit_bias contains 49152, outside the vocabulary"),
    ({"logit_bias": {5: 101.0}}, "sampling.logit_bias[5] must be in [-100, 100], got 101"),
    ({"logit_bias": {i: 1.0 for i in range(4097)}}, "sampling.logit_bias holds 4097 token ids; "
                                                     "the limit is 4096"),
])
def test_logit_processing_limits_on_both_front_doors(frontend, sampling, words):
    assert words in refusal(frontend, grpc_request(max_tokens=16, **sampling))
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 16, **sampling}
    if "logit_bias" in sampling:  # JSON keys are strings
        body["logit_bias"] = {str(k): v for k, v in sampling["logit_bias"].items()}
    assert words in refusal(frontend, parse(body, False, MODEL).request)


def test_logit_processing_travels_to_the_workers_unchanged(frontend):
    from common.convert import sampling_from_proto, sampling_to_proto

    job = frontend.parse(grpc_request(max_tokens=9, presence_penalty=0.5, frequency_penalty=-1.0,
                                      repetition_penalty=1.25, min_tokens=4,
                                      logit_bias={3: -100.0, 9: 2.5}), 0.0)
    p = job.params
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_tokens) == (
        0.5, -1.0, 1.25, 4)
    assert p.logit_bias == ((3, -100.0), (9, 2.5)) and p.processes_logits
    assert sampling_from_proto(sampling_to_proto(p)) == p
    plain = frontend.parse(grpc_request(max_tokens=9), 0.0).params
    assert not plain.processes_logits and sampling_from_proto(sampling_to_proto(plain)) == plain
    text = frontend.parse(grpc_request(max_tokens=9, stop=["x"], skip_special_tokens=False,
                                       include_stop_str_in_output=True), 0.0).params
    assert not text.skip_special_tokens and text.include_stop_str_in_output
    assert sampling_from_proto(sampling_to_proto(text)) == text
    assert plain.skip_special_tokens and not plain.include_stop_str_in_output


def test_stop_strings_are_counted(frontend):
    # every output token's text is searched for each one (the HTTP API refuses them in parse)
    assert refusal(frontend, grpc_request(stop=["a"] * 65)) == (
        "sampling.stop holds 65 stop strings; the limit is 64")
    assert frontend.parse(grpc_request(stop=["a"] * 64), 0.0).params.stop == ("a",) * 64


def _nested(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_an_invalid_json_schema_is_refused_by_the_router_naming_where(frontend):
    bad = {"type": "object", "properties": {"a": {"type": "integer", "minimum": "zero"}}}
    request = grpc_request(structured_output=pb.StructuredOutput(json_schema=json.dumps(bad)))
    assert refusal(frontend, request).startswith(
        "sampling.structured_output.json_schema is not a valid JSON Schema at "
        "properties/a/minimum: 'zero' is not of type 'number'")
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4,
            "response_format": {"type": "json_schema", "json_schema": {"schema": bad}}}
    assert "is not a valid JSON Schema" in refusal(frontend, parse(body, False, MODEL).request)
    # what the meta-schema check cannot take: a "$schema" that is no string, deep nesting
    for schema, words in (({"$schema": 5}, "is not a valid JSON Schema"),
                          ({"$schema": []}, "is not a valid JSON Schema"),
                          (_nested(150), "nests deeper than"),
                          ({"type": "string", "pattern": "(" * 1000 + ")" * 1000},
                           "nests deeper than")):
        request = grpc_request(structured_output=pb.StructuredOutput(
            json_schema=json.dumps(schema)))
        assert refusal(frontend, request).startswith(
            f"sampling.structured_output.json_schema {words}")
    choice = frontend.parse(grpc_request(structured_output=pb.StructuredOutput(
        choice=pb.Choices(choices=["a", "b"]))), 0.0)
    assert choice.params.structured_output.kind == "choice"
    assert "choice must be a non-empty list" in refusal(frontend, grpc_request(
        structured_output=pb.StructuredOutput(choice=pb.Choices(choices=["a", ""]))))
    assert "must set one of json_schema" in refusal(frontend, grpc_request(
        structured_output=pb.StructuredOutput()))


def test_chat_min_tokens_without_max_tokens_counts_against_the_rest_of_the_context(frontend):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "min_tokens": 32}
    job = frontend.parse(parse(body, True, MODEL).request, 0.0, rest_of_context=True)
    assert job.params.min_tokens == 32 and job.params.max_tokens > 32
    assert "min_tokens must be in [0, max_tokens=16]" in refusal(
        frontend, grpc_request(min_tokens=32))  # gRPC's default stays 16


def test_top_p_zero_is_greedy_on_both_front_doors(frontend):
    grpc_job = frontend.parse(grpc_request(temperature=1.0, top_p=0.0, seed=3), 0.0)
    http_job = frontend.parse(parse({"model": MODEL, "prompt": "hello", "temperature": 1,
                                     "top_p": 0, "seed": 3}, False, MODEL).request, 0.0)
    for job in (grpc_job, http_job):
        assert job.params.greedy and job.params.top_p == 1.0
    for bad in (5.0, -1.0, float("nan")):  # top_p 0 does not hide a bad temperature
        assert "sampling.temperature must be in [0, 2]" in refusal(
            frontend, grpc_request(temperature=bad, top_p=0.0))
    absent = frontend.parse(grpc_request(temperature=1.0), 0.0)  # absent top_p: disabled
    assert not absent.params.greedy and absent.params.top_p == 1.0


def test_any_int64_seed_maps_to_a_distinct_uint64(frontend):
    seeds = [frontend.parse(parse({"model": MODEL, "prompt": "x", "seed": seed}, False,
                                  MODEL).request, 0.0).params.seed
             for seed in (-1, -(2**63), 0, 2**63 - 1)]
    assert seeds == [2**64 - 1, 2**63, 0, 2**63 - 1]  # int64 onto uint64: one to one


def test_text_is_capped_by_size_before_it_is_tokenized(frontend):
    big = "a" * (MAX_TEXT_CHARS + 1)
    assert f"the limit is {MAX_TEXT_CHARS}" in refusal(frontend, pb.GenerateRequest(prompt=big))
    wide = "\u20ac" * (MAX_TEXT_BYTES // 3 + 1)  # 3 bytes each: under the chars, over the bytes
    assert f"the limit is {MAX_TEXT_BYTES}" in refusal(frontend, pb.GenerateRequest(prompt=wide))
    half = "a" * (MAX_TEXT_CHARS // 2 + 1)  # each message fits; together they do not
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=half)] * 2)
    assert refusal(frontend, pb.GenerateRequest(chat=chat)).startswith("chat.messages: 1000002 ")
    named = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="x",
                                                     name="n" * MAX_TEXT_CHARS)])
    assert "the limit is 1000000" in refusal(frontend, pb.GenerateRequest(chat=named))
    many = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="a")]
                           * (MAX_CHAT_MESSAGES + 1))
    assert "the limit is 4096" in refusal(frontend, pb.GenerateRequest(chat=many))
    stops = pb.SamplingOptions(stop=["a" * (MAX_TEXT_CHARS + 1)])
    assert refusal(frontend, pb.GenerateRequest(prompt="x", sampling=stops)).startswith(
        "sampling.stop: ")
    ids = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[1] * (MAX_PROMPT_TOKEN_IDS + 1)))
    assert "holds 1000001 token ids; the limit is 1000000" in refusal(frontend, ids)


def test_developer_is_system_and_tool_turns_need_their_call_id(frontend):
    def chat(*turns: pb.ChatMessage) -> pb.GenerateRequest:
        return pb.GenerateRequest(chat=pb.ChatMessages(messages=list(turns)))

    as_developer = frontend.parse(chat(pb.ChatMessage(role="developer", content="be brief"),
                                       pb.ChatMessage(role="user", content="hi")), 0.0)
    as_system = frontend.parse(chat(pb.ChatMessage(role="system", content="be brief"),
                                    pb.ChatMessage(role="user", content="hi")), 0.0)
    assert as_developer.token_ids == as_system.token_ids
    with_tool = frontend.parse(chat(pb.ChatMessage(role="user", content="2+2?"),
                                    pb.ChatMessage(role="tool", content="4",
                                                   tool_call_id="call_1")), 0.0)
    assert "4" in frontend.tokenizer.decode(with_tool.token_ids)
    assert "tool_call_id is required" in refusal(
        frontend, chat(pb.ChatMessage(role="tool", content="4")))
    assert "role must be one of system, developer, user, assistant, tool" in refusal(
        frontend, chat(pb.ChatMessage(role="robot", content="x")))


def test_chat_without_max_tokens_gets_the_rest_of_the_context_in_one_tokenization(frontend):
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(role="user", content="hi")]))
    job = frontend.parse(request, 0.0, rest_of_context=True)
    assert len(job.token_ids) + job.params.max_tokens == \
        frontend.model_config.max_position_embeddings
    assert frontend.parse(request, 0.0).params.max_tokens == 16  # gRPC's default


def test_a_call_without_a_deadline_gets_the_default():
    no_deadline = 9.2e18  # what grpc reports for a call without one
    assert call_budget_s(no_deadline, 600.0) == 600.0
    assert call_budget_s(None, 42.0) == 42.0
    assert call_budget_s(float("inf"), 42.0) == 42.0
    assert call_budget_s(NO_DEADLINE_S - 1, 42.0) == NO_DEADLINE_S - 1
    assert call_budget_s(-3.0, 42.0) == 0.0
    scope = CallScope(call_budget_s(no_deadline, 600.0))
    assert 599.0 < scope.timeout() <= 600.0  # a usable timeout for the worker calls
    with pytest.raises(Exception) as past:
        CallScope(call_budget_s(-1.0, 600.0)).timeout()
    assert getattr(past.value, "code", None) is grpc.StatusCode.DEADLINE_EXCEEDED

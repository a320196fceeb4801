"""What real clients ask for (issue 30), through the shared 1P+1D cluster of the tiny model
(`openai_cluster`, remote prefill) with the official `openai` client and gRPC: penalties,
logit_bias and min_tokens; /tokenize and /detokenize; echo with prompt logprobs (lm-eval's
request); batches and n; structured output (`.parse()`, regex, choice); tool calls."""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from common.grpc_server import channel
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc
from tests.cluster.openai_helpers import PROMPT, grpc_complete, raw

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(openai_cluster):
    return openai_cluster


def test_penalties_logit_bias_and_min_tokens_with_the_openai_client(client, model,
                                                                     tiny_llama_dir):
    """Prefilled remotely (the first token is sampled on the prefill worker, the rest on the
    decode worker): the same tokens as the offline engine with the same parameters."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    llm = LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                  cache=CacheConfig(num_blocks=64)))
    prompt = llm.tokenizer.encode(PROMPT)
    # The bias makes token 17 the argmax; the penalties push it down as it repeats.
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0, logprobs=0,
        frequency_penalty=1.5, presence_penalty=0.5, logit_bias={"17": 13},
        extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    expected = llm.generate([prompt], SamplingParams(
        temperature=0, max_tokens=12, frequency_penalty=1.5, presence_penalty=0.5,
        logit_bias={17: 13.0}, repetition_penalty=1.2, ignore_eos=True))[0]
    assert reply.choices[0].text == expected.text and reply.usage.completion_tokens == 12
    assert 0 < expected.token_ids.count(17) < 12
    (eos,) = llm.engine.eos_token_ids
    for min_tokens in (0, 4):  # EOS made the argmax: it ends the request after min_tokens
        ended = client.completions.create(model=model, prompt=prompt, max_tokens=10,
                                          temperature=0, logit_bias={str(eos): 100},
                                          extra_body={"min_tokens": min_tokens})
        assert ended.choices[0].finish_reason == "stop"
        assert ended.usage.completion_tokens == min_tokens + 1
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", presence_penalty=2.5)
    assert bad.value.body["message"] == "presence_penalty must be in [-2, 2], got 2.5"
    assert bad.value.body["param"] == "presence_penalty"


def test_stop_strings_min_tokens_and_vllms_text_options_as_the_offline_engine(
        client, model, tiny_llama_dir):
    """The router builds the text the client reads, the workers find where the request stops:
    both as the offline engine does, with the stop string kept, a stop string inside the first
    min_tokens tokens' text, a stop token id, and special tokens kept."""
    from engine.config import CacheConfig, EngineConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    llm = LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                  cache=CacheConfig(num_blocks=64)))
    prompt = llm.tokenizer.encode(PROMPT)
    base = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=24,
                                                 ignore_eos=True))[0]
    assert len(base.text) > 16
    (eos,) = llm.engine.eos_token_ids
    eos_bias = {"logit_bias": {str(eos): 100}}
    cases = [({"stop": [base.text[10:14]], "include_stop_str_in_output": True}, {}),
             ({"stop": [base.text[1:3]], "min_tokens": 8}, {}),
             ({"stop_token_ids": [base.token_ids[5]]}, {}),
             ({"skip_special_tokens": False, "min_tokens": 3}, eos_bias),
             ({"skip_special_tokens": False, "min_tokens": 3,
               "include_stop_str_in_output": True}, eos_bias)]
    texts = []
    for extra, openai_args in cases:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=24,
                                          temperature=0, extra_body=extra, **openai_args)
        bias = {eos: 100.0} if openai_args else {}
        params = {k: tuple(v) if k in ("stop", "stop_token_ids") else v
                  for k, v in extra.items()}
        expected = llm.generate([prompt], SamplingParams(
            temperature=0, max_tokens=24, logit_bias=bias, **params))[0]
        choice = reply.choices[0]
        assert (choice.text, choice.finish_reason) == (expected.text, expected.finish_reason)
        assert reply.usage.completion_tokens == len(expected.token_ids)
        texts.append(expected.text)
    # The stop token's and the EOS's own text are left out (as vLLM), unless the stop is kept.
    assert not texts[3].endswith("<|im_end|>") and texts[4] == texts[3] + "<|im_end|>"


def test_tokenize_and_detokenize_over_http_and_grpc(cluster, http_address, model):
    conn, reply = raw(http_address, "/tokenize", {"model": model, "prompt": PROMPT,
                                                  "return_token_strs": True})
    body = json.loads(reply.read())
    conn.close()
    assert reply.status == 200 and body["count"] == len(body["tokens"]) == len(body["token_strs"])
    completion = grpc_complete(cluster, pb.GenerateRequest(
        prompt=PROMPT, sampling=pb.SamplingOptions(max_tokens=1, temperature=0)))
    assert completion.usage.prompt_tokens == body["count"]
    conn, reply = raw(http_address, "/detokenize", {"tokens": body["tokens"]})
    assert reply.status == 200 and json.loads(reply.read())["prompt"] == PROMPT
    conn.close()
    conn, reply = raw(http_address, "/detokenize", {"tokens": [10**9]})
    error = json.loads(reply.read())["error"]
    conn.close()
    assert reply.status == 400 and error["param"] == "tokens" and "vocabulary" in error["message"]
    with channel(cluster.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        chat = stub.Tokenize(pb.TokenizeRequest(chat=pb.ChatMessages(messages=[
            pb.ChatMessage(role="user", content="Hi")])), timeout=30)
        assert stub.Detokenize(pb.DetokenizeRequest(token_ids=chat.token_ids), timeout=30).text
        with pytest.raises(grpc.RpcError) as bad:
            stub.Tokenize(pb.TokenizeRequest(), timeout=30)
        assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "one of prompt or chat" in bad.value.details()


def test_echo_with_logprobs_scores_the_prompt_as_transformers_does(client, model, http_address,
                                                                   tiny_llama_dir):
    """lm-eval's loglikelihood request (token ids, echo, logprobs 1, max_tokens 1), prefilled
    remotely: the prompt's token logprobs are transformers' log-softmax over it."""
    import torch
    from transformers import AutoModelForCausalLM

    from engine.tokenizer import Tokenizer

    prompt = Tokenizer(tiny_llama_dir).encode(PROMPT)
    reply = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0,
                                      echo=True, logprobs=1)
    lp = reply.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + 1 and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    for p in range(1, len(prompt)):
        assert abs(lp.token_logprobs[p] - expected[p - 1, prompt[p]].item()) < 1e-4
        assert len(lp.top_logprobs[p]) <= 2
    text = reply.choices[0].text
    plain = client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    assert text.endswith(plain.choices[0].text) and len(text) > len(plain.choices[0].text)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=3,
                                            temperature=0, echo=True, logprobs=0, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.token_logprobs
                                            if c.choices[0].logprobs else [])]
    assert streamed[0] is None and len(streamed) == len(prompt) + 3
    conn, bad = raw(http_address, "/v1/chat/completions", {
        "model": model, "messages": [{"role": "user", "content": "x"}], "echo": True})
    assert bad.status == 400 and json.loads(bad.read())["error"]["param"] == "echo"
    conn.close()


def test_batches_of_prompts_and_n_samples_with_the_openai_client(client, model, tiny_llama_dir,
                                                                 http_address):
    """Each prompt of a batch and each of n samples is a choice of its own, answered in order
    (index = prompt x n + sample), streamed interleaved with its index; the usage counts each
    prompt once; sample j > 0 forks from sample 0's prompt KV and draws with seed + j. (This
    cluster runs 2 requests at once and queues none: 2 choices at most.)"""
    from engine.tokenizer import Tokenizer

    single = [client.completions.create(model=model, prompt=p, max_tokens=5, temperature=0)
              for p in (PROMPT, "Hello world")]
    batch = client.completions.create(model=model, prompt=[PROMPT, "Hello world"], max_tokens=5,
                                      temperature=0)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in single]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    ids = Tokenizer(tiny_llama_dir).encode("Hello world")
    by_ids = client.completions.create(model=model, prompt=[ids, ids[:2]], max_tokens=5,
                                       temperature=0)
    assert by_ids.choices[0].text == single[1].choices[0].text
    forks_before = _forked_samples(http_address)
    seeded = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2, seed=5,
                                       temperature=1.0)
    assert _forked_samples(http_address) == forks_before + 1  # sample 1 forked from sample 0
    second = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, seed=6,
                                       temperature=1.0)
    assert seeded.choices[1].text == second.choices[0].text
    alone = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, seed=5,
                                      temperature=1.0)
    assert seeded.choices[0].text == alone.choices[0].text
    assert seeded.usage.prompt_tokens == alone.usage.prompt_tokens
    assert seeded.usage.completion_tokens == 12
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=2,
                                            seed=5, temperature=1.0, stream=True))
    streamed = ["".join(c.choices[0].text for c in chunks if c.choices[0].index == i)
                for i in (0, 1)]
    assert streamed == [c.text for c in seeded.choices]
    chat = client.chat.completions.create(model=model, n=2, max_tokens=4, temperature=0,
                                          messages=[{"role": "user", "content": PROMPT}])
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content


def test_structured_output_with_the_openai_clients_parse(client, model):
    """openai's `.parse()` (a pydantic model as a strict json_schema response format) and a
    regex and a choice as vLLM's extensions, prefilled remotely: the prefill worker samples the
    first token under the mask, the decode worker continues the same constraint."""
    import re
    from typing import Literal

    import pydantic

    class Verdict(pydantic.BaseModel):
        answer: Literal["yes", "no", "maybe"]
        sure: bool

    messages = [{"role": "user", "content": "Is the sky blue?"}]
    parsed = client.chat.completions.parse(model=model, messages=messages, max_tokens=400,
                                           temperature=0, response_format=Verdict)
    verdict = parsed.choices[0].message.parsed
    assert isinstance(verdict, Verdict) and parsed.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=400, temperature=0, stream=True,
        response_format={"type": "json_object"}))
    assert isinstance(json.loads("".join(c.choices[0].delta.content or "" for c in chunks)), dict)
    regex = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{4}"}})
    assert re.fullmatch("[0-9]{4}", regex.choices[0].text)
    choice = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=1,
                                       seed=3, extra_body={"guided_choice": ["left", "right"]})
    assert choice.choices[0].text in ("left", "right")
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model, prompt="x", extra_body={
            "structured_outputs": {"regex": "[a-"}})
    assert "Unclosed '['" in bad.value.body["message"]


def test_tool_calls_with_the_openai_client(client, model):
    """A named function and `required` hold the output to a call (structured output over the
    parameters), whole and streamed (the arguments in fragments as they come); `auto` is
    refused for this template (it writes no tool-call format); a history with the assistant's
    calls and the tool's answers renders."""
    import jsonschema

    weather = {"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                       "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]}}}}}
    clock = {"type": "function", "function": {"name": "get_time"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0, tools=[weather, clock],
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), weather["function"]["parameters"])
    assert named.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(
        model=model, messages=messages, max_tokens=200, temperature=0, tools=[weather, clock],
        tool_choice="required", stream=True))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name in ("get_weather", "get_time") and deltas[0].id
    assert {d.index for d in deltas} == {0} and not any(d.id for d in deltas[1:])
    arguments = "".join(d.function.arguments or "" for d in deltas)
    if deltas[0].function.name == "get_weather":
        assert len(deltas) > 2  # the arguments streamed in fragments
        jsonschema.validate(json.loads(arguments), weather["function"]["parameters"])
    assert json.loads(arguments) is not None
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with client.chat.completions.stream(  # openai's own accumulation of the deltas
            model=model, messages=messages, max_tokens=200, temperature=0, tools=[weather],
            tool_choice={"type": "function", "function": {"name": "get_weather"}}) as stream:
        final = stream.get_final_completion()
    streamed_call = final.choices[0].message.tool_calls[0]
    assert streamed_call.function.name == "get_weather"
    assert json.loads(streamed_call.function.arguments) == json.loads(call.function.arguments)
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, tools=[weather],
                                       tool_choice="auto")
    assert refused.value.body["param"] == "tool_choice"
    history = messages + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    answer = client.chat.completions.create(model=model, messages=history, max_tokens=5,
                                            temperature=0, tools=[weather], tool_choice="none")
    assert answer.choices[0].message.tool_calls is None


def test_grpc_batches_and_n_samples_interleave_with_their_index(cluster, model, tiny_llama_dir):
    from engine.tokenizer import Tokenizer

    ids = Tokenizer(tiny_llama_dir).encode(PROMPT)
    greedy = pb.SamplingOptions(max_tokens=5, temperature=0)
    singles = [grpc_complete(cluster, pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=p),
                                                          sampling=greedy)).token_ids
               for p in (ids, ids[:4])]
    with channel(cluster.address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        parts = list(stub.Generate(pb.GenerateRequest(
            batch=pb.PromptBatch(token_ids=[pb.TokenIds(ids=ids), pb.TokenIds(ids=ids[:4])]),
            sampling=greedy), timeout=120))
        got = [[t for p in parts if p.index == i for t in p.token_ids] for i in (0, 1)]
        assert got == [list(s) for s in singles]
        assert sum(p.finish_reason != pb.FINISH_REASON_UNSPECIFIED for p in parts) == 2
        seeded = pb.SamplingOptions(max_tokens=6, temperature=1.0, seed=11)
        alone = grpc_complete(cluster, pb.GenerateRequest(prompt=PROMPT, sampling=seeded))
        samples = list(stub.Generate(pb.GenerateRequest(prompt=PROMPT, sampling=seeded, n=2),
                                     timeout=120))
        assert [t for p in samples if p.index == 0 for t in p.token_ids] == list(alone.token_ids)
        for bad, words in ((pb.GenerateRequest(prompt=PROMPT, n=2), "Complete answers one"),
                           (pb.GenerateRequest(batch=pb.PromptBatch(prompts=["a"], token_ids=[
                               pb.TokenIds(ids=[1])])), "one kind only")):
            with pytest.raises(grpc.RpcError) as refused:
                (stub.Complete if "Complete" in words else
                 lambda r, timeout: list(stub.Generate(r, timeout=timeout)))(bad, timeout=30)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert words in refused.value.details()


def test_grpc_tool_choice_holds_the_output_to_a_call_and_parses_it(cluster):
    import jsonschema

    parameters = {"type": "object", "additionalProperties": False, "required": ["city"],
                  "properties": {"city": {"enum": ["Paris", "Oslo"]}}}
    tools = json.dumps([{"type": "function", "function": {"name": "get_weather",
                                                          "parameters": parameters}}])
    chat = pb.ChatMessages(tools_json=tools, messages=[pb.ChatMessage(role="user",
                                                                      content="Weather?")])
    sampling = pb.SamplingOptions(max_tokens=200, temperature=0)
    for choice in (pb.ToolChoice(function="get_weather"), pb.ToolChoice(mode="required")):
        reply = grpc_complete(cluster, pb.GenerateRequest(chat=chat, sampling=sampling,
                                                          tool_choice=choice))
        assert [c.name for c in reply.tool_calls] == ["get_weather"]
        jsonschema.validate(json.loads(reply.tool_calls[0].arguments), parameters)
    for choice, words in ((pb.ToolChoice(mode="auto"), "needs a chat template"),
                          (pb.ToolChoice(function="nope"), "names 'nope'"),
                          (pb.ToolChoice(mode="sometimes"), "tool_choice.mode must be")):
        with pytest.raises(grpc.RpcError) as refused:
            grpc_complete(cluster, pb.GenerateRequest(chat=chat, sampling=sampling,
                                                      tool_choice=choice))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert words in refused.value.details()


def _forked_samples(http_address: str) -> float:
    from tests.cluster.cluster_helpers import scrape

    return scrape(http_address).get(
        "pdserve_router_prefill_sites_total{reason=sample of n,site=fork}", 0.0)

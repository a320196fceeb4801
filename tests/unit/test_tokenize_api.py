"""Tokenize and Detokenize (the gRPC calls and vLLM's HTTP bodies): the router's tokenizer,
chat rendering and limits, with the default model's tokenizer; no workers."""

from __future__ import annotations

import pytest

from engine.config import ModelConfig
from engine.tokenizer import Tokenizer
from pdserve_proto import pdserve_pb2 as pb
from router.frontdoor.openai_codec import ApiError
from router.frontdoor.tokenize_api import (
    detokenize_json,
    detokenize_request,
    tokenize_json,
    tokenize_request,
)
from router.frontdoor.validation import Frontend

MODEL = "m"
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]


@pytest.fixture(scope="module")
def frontend(default_model_dir) -> Frontend:
    return Frontend(Tokenizer(default_model_dir), ModelConfig.from_dir(default_model_dir), MODEL)


def test_a_prompt_tokenizes_as_a_generation_prompt_and_detokenizes_back(frontend):
    text = "The capital of France is Paris."
    reply = frontend.tokenize(tokenize_request({"prompt": text, "return_token_strs": True}))
    ids = frontend.tokenizer.encode(text)
    body = tokenize_json(reply, True)
    assert body["tokens"] == ids and body["count"] == len(ids)
    assert body["max_model_len"] == frontend.model_config.max_position_embeddings
    assert "".join(body["token_strs"]).replace("Ġ", " ") == text
    back = frontend.detokenize(detokenize_request({"tokens": ids, "model": MODEL}))
    assert detokenize_json(back) == {"prompt": text}
    assert tokenize_json(reply, False)["token_strs"] is None


def test_chat_renders_the_template_as_a_chat_request_does(frontend):
    job = frontend.parse(pb.GenerateRequest(chat=pb.ChatMessages(messages=[
        pb.ChatMessage(**m) for m in CHAT])), 0.0)
    reply = frontend.tokenize(tokenize_request({"messages": CHAT}))
    assert list(reply.token_ids) == job.token_ids
    bare = frontend.tokenize(tokenize_request({"messages": CHAT, "add_generation_prompt": False}))
    assert list(bare.token_ids) == job.token_ids[:len(bare.token_ids)]
    assert len(bare.token_ids) < len(job.token_ids)


@pytest.mark.parametrize("body, status, param, words", [
    ({"prompt": "x", "messages": CHAT}, 400, "prompt", "exactly one of prompt or messages"),
    ({}, 400, "prompt", "exactly one of prompt or messages"),
    ({"prompt": 3}, 400, "prompt", "a string"),
    ({"messages": []}, 400, "messages", "at least 1"),
    ({"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens", "true or false"),
])
def test_bad_tokenize_bodies_name_the_field(body, status, param, words):
    with pytest.raises(ApiError) as caught:
        tokenize_request(body)
    error = caught.value
    assert (error.status, error.param) == (status, param) and words in error.message


def test_the_shared_limits_and_the_model_name(frontend):
    with pytest.raises(ValueError, match=r"token_ids contains 49152, outside the vocabulary"):
        frontend.detokenize(detokenize_request({"tokens": [5, 49152]}))
    with pytest.raises(ApiError, match=r"tokens\[0\] must be >= 0"):
        detokenize_request({"tokens": [-1]})
    with pytest.raises(ValueError, match="model 'other' is not served here"):
        frontend.tokenize(tokenize_request({"prompt": "x", "model": "other"}))
    with pytest.raises(ValueError, match="prompt: 1000001 characters; the limit is 1000000"):
        frontend.tokenize(tokenize_request({"prompt": "x" * 1_000_001}))
    with pytest.raises(ValueError, match=r"chat.messages\[0\].role must be one of"):
        frontend.tokenize(tokenize_request({"messages": [{"role": "robot", "content": "x"}]}))

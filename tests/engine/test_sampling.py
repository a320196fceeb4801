"""Sampling semantics through the whole engine (tiny random Llama and the default model)."""

from __future__ import annotations

import math

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from tests.conftest import mixed_prompts


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=512)))


@pytest.fixture(scope="module")
def smol(default_model_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(default_model_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=256)))


def test_same_seed_same_output_alone_or_in_a_batch(tiny, workload_prompts):
    prompts = mixed_prompts(workload_prompts, 8)
    seeded = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234, max_tokens=12)
    alone = tiny.generate([prompts[3]], seeded)[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=12, seed=i) for i in range(7)]
    batch = tiny.generate(prompts[:3] + [prompts[3]] + prompts[4:],
                          others[:3] + [seeded] + others[3:])
    assert batch[3].token_ids == alone
    again = tiny.generate([prompts[3]], seeded)[0].token_ids
    assert again == alone
    different = tiny.generate([prompts[3]], SamplingParams(temperature=1.0, top_p=0.9, top_k=50,
                                                           seed=99, max_tokens=12))[0]
    assert different.token_ids != alone


def test_top_k_one_is_greedy(tiny, workload_prompts):
    prompts = mixed_prompts(workload_prompts, 4)
    greedy = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=8))
    top1 = tiny.generate(prompts, SamplingParams(temperature=1.5, top_k=1, max_tokens=8))
    tiny_p = tiny.generate(prompts, SamplingParams(temperature=1.0, top_p=1e-6, max_tokens=8))
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]
    assert [o.token_ids for o in tiny_p] == [o.token_ids for o in greedy]


def test_a_temperature_below_1e_5_is_greedy(tiny, workload_prompts):
    """As vLLM's. 1e-39 used to overflow the scaled logits: NaN probabilities, token 0 for
    every row."""
    prompts = mixed_prompts(workload_prompts, 4)
    greedy = tiny.generate(prompts, SamplingParams(temperature=0, max_tokens=6))
    for temperature in (1e-39, 9e-6):
        tiny_t = tiny.generate(prompts, SamplingParams(temperature=temperature, seed=1,
                                                       max_tokens=6))
        assert [o.token_ids for o in tiny_t] == [o.token_ids for o in greedy]
    assert not SamplingParams(temperature=1e-5).greedy


def test_sampling_draws_from_the_distribution(tiny, workload_prompts):
    prompt = workload_prompts[0][:20]
    outs = tiny.generate([prompt] * 24, SamplingParams(temperature=1.0, max_tokens=1))
    assert len({o.token_ids[0] for o in outs}) > 1  # unseeded rows draw independently


def test_logprobs(tiny, workload_prompts):
    prompt = workload_prompts[1][:30]
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=5, logprobs=3))[0]
    assert out.logprobs is not None and len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and 3 <= len(entry) <= 4
        assert all(v <= 0 for v in entry.values())
        assert entry[token] == pytest.approx(max(entry.values()))  # greedy picks the top one
    assert sum(math.exp(v) for v in out.logprobs[0].values()) <= 1.0 + 1e-5
    plain = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=5))[0]
    assert plain.logprobs is None and plain.token_ids == out.token_ids


def test_max_tokens_and_stop_token_ids(tiny, workload_prompts):
    prompt = workload_prompts[2][:40]
    base = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=10))[0]
    assert len(base.token_ids) == 10 and base.finish_reason == "length"
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = tiny.generate([prompt], SamplingParams(temperature=0, max_tokens=10,
                                                 stop_token_ids=(stop_id,)))[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id


def test_stop_string_truncates_text_and_streamed_deltas_add_up(smol):
    prompt = "The history of the Python programming language"
    base = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    assert len(base.text) > 30
    stop = base.text[20:26]
    params = SamplingParams(temperature=0, max_tokens=40, stop=(stop,))
    streamed = ""
    final = None
    for step_outputs in smol.stream(prompt, params):
        for o in step_outputs:
            streamed += o.new_text
            final = o
    assert final.finished and final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == base.text[: base.text.index(stop)]
    assert streamed == final.text


def test_a_stop_string_spanning_a_continuation_ends_the_continued_request(smol):
    # A request continued on another worker (the router's migration: the prompt extended by
    # the tokens already streamed, continued_tokens of them) stops where the whole request would
    # have, for a stop string that began in the output it continues.
    prompt = smol.tokenizer.encode("The history of the Python programming language")
    base = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=24))[0]
    head = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=8))[0]
    assert base.text.startswith(head.text) and len(head.text) >= 3
    stop = base.text[len(head.text) - 3:len(head.text) + 2]  # across tokens 8 and 9
    assert base.text.index(stop) == len(head.text) - 3
    whole = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=24, stop=(stop,)))[0]
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 8
    continued = SamplingParams(temperature=0, max_tokens=16, stop=(stop,), continued_tokens=8)
    rest = smol.generate([prompt + head.token_ids], continued)[0]
    assert rest.finish_reason == "stop" and rest.stop_reason == stop
    assert head.token_ids + rest.token_ids == whole.token_ids
    assert rest.text == ""  # the stop string began before this request's output


def test_the_text_keeps_the_stop_string_or_special_tokens_when_asked(smol):
    prompt = "The history of the Python programming language"
    base = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40))[0]
    stop = base.text[20:26]
    kept = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40, stop=(stop,),
                                                  include_stop_str_in_output=True))[0]
    assert kept.finish_reason == "stop" and kept.text == base.text[: base.text.index(stop) + 6]
    ids = smol.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    plain = smol.generate([ids], SamplingParams(temperature=0, max_tokens=60))[0]
    special = smol.generate([ids], SamplingParams(temperature=0, max_tokens=60,
                                                  skip_special_tokens=False))[0]
    assert special.token_ids == plain.token_ids and plain.finish_reason == "stop"
    # As vLLM: the EOS that ended it is left out of the text, unless the stop is kept.
    assert special.text == plain.text
    kept_eos = smol.generate([ids], SamplingParams(temperature=0, max_tokens=60,
                                                   skip_special_tokens=False,
                                                   include_stop_str_in_output=True))[0]
    assert kept_eos.text == plain.text + "<|im_end|>"
    stop_id = base.token_ids[6]  # a stop token id's text stays out too
    first = base.token_ids.index(stop_id)
    cut = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=40,
                                                 stop_token_ids=(stop_id,)))[0]
    assert cut.finish_reason == "stop" and cut.token_ids == base.token_ids[:first + 1]
    before = smol.generate([prompt], SamplingParams(temperature=0, max_tokens=first))[0]
    assert cut.text == before.text and len(before.text) < len(base.text)


def test_eos_stops_and_ignore_eos_continues(smol):
    messages = [{"role": "user", "content": "Say hello."}]
    ids = smol.tokenizer.encode_chat(messages)
    out = smol.generate([ids], SamplingParams(temperature=0, max_tokens=60))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] in smol.engine.eos_token_ids
    longer = smol.generate([ids], SamplingParams(temperature=0, max_tokens=len(out.token_ids) + 5,
                                                 ignore_eos=True))[0]
    assert longer.finish_reason == "length"
    assert longer.token_ids[: len(out.token_ids)] == out.token_ids
    assert len(longer.token_ids) == len(out.token_ids) + 5

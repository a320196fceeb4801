"""Penalties, logit_bias and min_tokens (engine.logits_processing), exactly as a plain-torch
reference computes them row by row, and through the whole engine against transformers'
generate (repetition penalty, sequence bias, min_new_tokens) and a step-by-step plain-torch
greedy loop (presence and frequency penalties, which transformers lacks)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.logits_processing import RowHistory, process_logits
from engine.request import Request, SamplingParams
from engine.token_counts import TokenCounts, output_history
from tests.conftest import mixed_prompts

VOCAB = 50
EOS = 2


def reference_row(logits: torch.Tensor, p: SamplingParams, prompt: list[int],
                  output: list[int]) -> torch.Tensor:
    """One row, token by token, in vLLM's order: bias, min_tokens, repetition, frequency,
    presence."""
    x = logits.clone()
    for token, bias in p.logit_bias:
        x[token] += bias
    if len(output) < p.min_tokens:
        for token in ((() if p.ignore_eos else (EOS,)) + p.stop_token_ids):
            x[token] = float("-inf")
    for token in set(prompt + output) if p.repetition_penalty != 1.0 else set(output):
        x[token] = x[token] / p.repetition_penalty if x[token] > 0 else \
            x[token] * p.repetition_penalty
    for token in set(output):
        count = float(output.count(token))
        x[token] = x[token] - p.frequency_penalty * count
        x[token] = x[token] - p.presence_penalty * 1.0
    return x


def history(p: SamplingParams, prompt: list[int], output: list[int],
            pending_row: int | None = None) -> RowHistory:
    stops = tuple(dict.fromkeys((() if p.ignore_eos else (EOS,)) + p.stop_token_ids))
    return RowHistory(prompt, output, stops, pending_row)


def test_each_processing_equals_the_plain_torch_reference_and_plain_rows_are_untouched():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(7, VOCAB, generator=gen) * 3
    prompt, output = [5, 6, 6, 7, 40], [6, 9, 9, 9, 11, 40]
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, repetition_penalty=0.6),
        SamplingParams(frequency_penalty=0.8, presence_penalty=-0.5),
        SamplingParams(logit_bias={9: -100.0, 13: 7.5}, max_tokens=20, min_tokens=10,
                       stop_token_ids=(11,)),
        SamplingParams(logit_bias={6: 3.0}, repetition_penalty=1.2, frequency_penalty=-1.5,
                       presence_penalty=2.0, min_tokens=3, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0, min_tokens=6, max_tokens=20),  # reached: nothing masked
    ]
    histories = [history(p, prompt, output) if p.processes_logits else None for p in params]
    got = process_logits(logits, params, [len(output)] * 7, histories)
    for row, p in enumerate(params):
        torch.testing.assert_close(got[row], reference_row(logits[row], p, prompt, output),
                                   rtol=0, atol=0)
    assert torch.equal(got[0], logits[0]) and got is not logits
    assert process_logits(logits, params[:1], [0], [None]) is logits  # nothing asked: no copy


def test_a_pending_token_on_the_device_counts_as_output():
    """Async scheduling: the last sampled token is still on the device when the next step
    samples; the penalties count it as the host would."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, VOCAB, generator=gen)
    p = SamplingParams(frequency_penalty=1.0, repetition_penalty=1.3)
    device_tokens = torch.tensor([31, 9, 4])
    got = process_logits(logits, [p, p], [3, 3],
                         [history(p, [1], [9, 9], pending_row=1),
                          history(p, [1], [9, 9], pending_row=2)], device_tokens)
    torch.testing.assert_close(got[0], reference_row(logits[0], p, [1], [9, 9, 9]), rtol=0, atol=0)
    torch.testing.assert_close(got[1], reference_row(logits[1], p, [1], [9, 9, 4]), rtol=0, atol=0)


def test_counts_kept_on_the_device_equal_the_history_recounted():
    """engine.token_counts adds each step's new tokens to rows it keeps; the processed logits
    equal those of the history counted afresh, step after step, with a pending token, a
    continued request, rows freed and reused, and an id reused by a new request."""
    gen = torch.Generator().manual_seed(2)
    counts = TokenCounts(VOCAB, torch.device("cpu"))
    p = SamplingParams(frequency_penalty=0.7, presence_penalty=0.3, repetition_penalty=1.4)
    continued = SamplingParams(frequency_penalty=0.7, continued_tokens=3)
    requests = [Request("a", [1, 2, 3], p), Request("b", [4, 5, 6, 7, 8, 9], continued),
                Request("c", [10], SamplingParams(frequency_penalty=-1.0))]
    for step in range(6):
        for k, request in enumerate(requests):
            request.output_token_ids.append((step * 7 + k * 3) % VOCAB)
        if step == 3:  # "c" leaves; a new request takes its id (and its row)
            counts.retain({r.request_id: r for r in requests[:2]})
            requests[2] = Request("c", [11, 12], SamplingParams(presence_penalty=1.5))
        logits = torch.randn(3, VOCAB, generator=gen)
        params = [r.params for r in requests]
        device_tokens = torch.tensor([step % VOCAB])
        kept = [history(r.params, r.prompt_token_ids, r.output_token_ids) for r in requests]
        for h, r in zip(kept, requests):
            h.request = r
        kept[0].pending_row = 0
        fresh = [history(r.params, r.prompt_token_ids, output_history(r)) for r in requests]
        fresh[0].pending_row = 0
        got = process_logits(logits, params, [0] * 3, kept, device_tokens, counts)
        want = process_logits(logits, params, [0] * 3, fresh, device_tokens)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert len(counts) == 3


def test_a_continuation_samples_as_the_request_it_continues(tiny, workload_prompts):
    """After a migration the router continues a request with its streamed tokens in the prompt
    (`continued_tokens`): with penalties and a seed, the rest of the output is what the
    undisturbed request produced."""
    prompt = workload_prompts[4][:30]
    for p in (SamplingParams(temperature=0.9, seed=5, max_tokens=16, ignore_eos=True,
                             frequency_penalty=1.2, presence_penalty=0.4),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             frequency_penalty=1.5, repetition_penalty=1.3)):
        whole = tiny.generate([prompt], p)[0].token_ids
        rest = tiny.generate([prompt + whole[:6]], dataclasses.replace(
            p, max_tokens=10, continued_tokens=6))[0].token_ids
        assert rest == whole[6:]
    with pytest.raises(ValueError, match="continued_tokens"):
        tiny.generate([prompt[:3]], SamplingParams(continued_tokens=3))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=512)))


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def hf_generate(model, prompt: list[int], n: int, **kwargs: object) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt),
                             dtype=torch.long), max_new_tokens=n, do_sample=False,
                             pad_token_id=EOS, **kwargs)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_transformers_alone_and_in_a_mixed_batch(tiny, hf_model,
                                                                             workload_prompts):
    prompts = mixed_prompts(workload_prompts, 6)
    penalized = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                               repetition_penalty=1.8)
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [penalized if i % 2 else plain for i in range(len(prompts))]
    outs = tiny.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        expected = hf_generate(hf_model, prompt, 12, **(
            {"repetition_penalty": 1.8} if p.repetition_penalty != 1.0 else {}))
        assert out.token_ids == expected
    assert [o.token_ids for o in outs[::2]] == [o.token_ids for o in tiny.generate(prompts[::2],
                                                                                  plain)]


def test_logit_bias_and_min_tokens_match_transformers(tiny, hf_model, workload_prompts):
    """EOS pushed to the top by a bias: it ends the request at once without min_tokens, and
    exactly after min_tokens tokens with it (transformers: sequence_bias, min_new_tokens)."""
    prompt = workload_prompts[2][:25]
    (eos,) = tiny.engine.eos_token_ids
    for min_tokens in (0, 5):
        p = SamplingParams(temperature=0, max_tokens=10, logit_bias={eos: 100.0, 17: 3.0},
                           min_tokens=min_tokens)
        out = tiny.generate([prompt], p)[0]
        expected = hf_generate(hf_model, prompt, 10, sequence_bias={(eos,): 100.0, (17,): 3.0},
                               min_new_tokens=min_tokens, eos_token_id=eos)
        assert out.token_ids == expected and out.token_ids[-1] == eos
        assert len(out.token_ids) == min_tokens + 1 and out.finish_reason == "stop"


def plain_torch_greedy(model, prompt: list[int], p: SamplingParams) -> list[int]:  # noqa: ANN001
    """Greedy with the reference processing: the whole sequence through the model each step."""
    output: list[int] = []
    with torch.inference_mode():
        for _ in range(p.max_tokens):
            logits = model(torch.tensor([prompt + output])).logits[0, -1].float()
            output.append(int(reference_row(logits, p, prompt, output).argmax()))
    return output


def test_presence_and_frequency_penalties_match_a_plain_torch_greedy_loop(tiny, hf_model,
                                                                          workload_prompts):
    prompts = [workload_prompts[i][:n] for i, n in ((3, 20), (4, 33))]
    # The bias makes token 17 the argmax; the penalties then push it down as it repeats.
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logit_bias={17: 13.0},
                             frequency_penalty=1.5, presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                             presence_penalty=-2.0, repetition_penalty=1.1)]
    outs = tiny.generate(prompts, params)
    for prompt, p, out in zip(prompts, params, outs):
        assert out.token_ids == plain_torch_greedy(hf_model, prompt, p)
    bias_only = tiny.generate([prompts[0]], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True, logit_bias={17: 13.0}))[0].token_ids
    assert bias_only.count(17) > outs[0].token_ids.count(17) > 0  # the penalties did act


def test_penalties_under_async_scheduling_and_preemption_equal_the_synchronous_engine(
        tiny_llama_dir, workload_prompts):
    prompts = [workload_prompts[i][:n] for i, n in enumerate((9, 30, 17, 24))]
    params = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True,
                             frequency_penalty=1.0, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=3, max_tokens=11, presence_penalty=1.0,
                             min_tokens=11),
              SamplingParams(temperature=0, max_tokens=9, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=13, logit_bias={5: 4.0},
                             ignore_eos=True, frequency_penalty=0.7)]
    results = []
    for on in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                        async_scheduling=on, cache=CacheConfig(num_blocks=4),
                                        scheduler=SchedulerConfig(max_num_seqs=2)))
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            engine.add_request(prompt, p, request_id=str(i))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        bm = engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        results.append((done, engine.scheduler.num_preemptions))
    assert results[0][0] == results[1][0] and results[1][1] > 0

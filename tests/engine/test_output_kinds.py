"""The three output kinds (engine.request.OutputKind) on the tiny model: the same tokens, text and
logprobs handed over three ways — every step with everything so far, every step with only the
delta, or once at the end — and batch generation asking for the last."""

from __future__ import annotations

import dataclasses

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.engine import RequestOutput
from engine.llm import LLM
from engine.request import OutputKind, SamplingParams

# sampled (seeded), with logprobs and a stop string, so deltas of text are held back sometimes
BASE = SamplingParams(temperature=0.8, seed=7, max_tokens=24, ignore_eos=True, logprobs=2,
                      stop=("zz",))


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=256)))


@pytest.fixture(scope="module")
def prompts(workload_prompts) -> list[list[int]]:
    return [p[:20 + 7 * i] for i, p in enumerate(workload_prompts[:4])]


def streamed(llm: LLM, prompts: list[list[int]], kind: OutputKind
             ) -> dict[str, list[RequestOutput]]:
    params = dataclasses.replace(BASE, output_kind=kind)
    per_request: dict[str, list[RequestOutput]] = {}
    for outputs in llm.stream(prompts, params):
        for out in outputs:
            per_request.setdefault(out.request_id.rsplit("-", 1)[1], []).append(out)
    return per_request


def same_logprobs(got: list[dict[int, float]], expected: list[dict[int, float]]) -> None:
    """The same ids, values to float noise (a later run finds the prompts in the prefix cache,
    so it computes them in other shapes)."""
    assert [d.keys() for d in got] == [d.keys() for d in expected]
    for g, e in zip(got, expected):
        assert g == pytest.approx(e, abs=1e-4)


def test_every_kind_hands_over_the_same_tokens_text_and_logprobs(tiny, prompts):
    cumulative = streamed(tiny, prompts, OutputKind.CUMULATIVE)
    delta = streamed(tiny, prompts, OutputKind.DELTA)
    final = streamed(tiny, prompts, OutputKind.FINAL_ONLY)
    assert cumulative.keys() == delta.keys() == final.keys() == {"0", "1", "2", "3"}
    for i, outs in cumulative.items():
        whole = outs[-1]
        assert whole.finished and len(whole.token_ids) == BASE.max_tokens
        assert len(delta[i]) == len(outs)  # an output per step, as many as cumulative's
        assert [t for o in delta[i] for t in o.new_token_ids] == whole.token_ids
        assert "".join(o.text for o in delta[i]) == whole.text
        same_logprobs([lp for o in delta[i] for lp in o.logprobs], whole.logprobs)
        [only] = final[i]
        assert only.finished and only.new_token_ids == only.token_ids == whole.token_ids
        assert only.new_text == only.text == whole.text
        same_logprobs(only.logprobs, whole.logprobs)
        assert only.num_output_tokens == len(whole.token_ids)


def test_a_cumulative_output_holds_everything_so_far_and_a_delta_only_its_step(tiny, prompts):
    cumulative = streamed(tiny, prompts[:2], OutputKind.CUMULATIVE)
    delta = streamed(tiny, prompts[:2], OutputKind.DELTA)
    for i, outs in cumulative.items():
        so_far: list[int] = []
        for out, step in zip(outs, delta[i]):
            so_far += out.new_token_ids
            assert out.token_ids == so_far and out.num_output_tokens == len(so_far)
            assert step.token_ids == step.new_token_ids == out.new_token_ids
            assert step.text == step.new_text == out.new_text
            assert len(step.logprobs) == len(step.new_token_ids)
            assert step.num_output_tokens == len(so_far)
            assert step.finished == out.finished


def test_generate_builds_one_output_per_request_whatever_the_kind_asked(tiny, prompts):
    made: list[int] = []
    step = tiny.engine.step

    def counting_step() -> list[RequestOutput]:
        outputs = step()
        made.append(len(outputs))
        return outputs

    tiny.engine.step = counting_step
    try:
        asked = dataclasses.replace(BASE, output_kind=OutputKind.DELTA)
        outs = tiny.generate(prompts, asked)
    finally:
        del tiny.engine.step
    assert sum(made) == len(prompts) and len(made) >= BASE.max_tokens
    assert asked.output_kind is OutputKind.DELTA  # the caller's params are left as they were
    streamed_whole = streamed(tiny, prompts, OutputKind.CUMULATIVE)
    assert [o.token_ids for o in outs] == [streamed_whole[str(i)][-1].token_ids
                                           for i in range(len(prompts))]
    assert [o.text for o in outs] == [streamed_whole[str(i)][-1].text
                                      for i in range(len(prompts))]


def test_an_aborted_request_gets_its_output_whatever_its_kind(tiny, prompts):
    engine = tiny.engine
    params = dataclasses.replace(BASE, output_kind=OutputKind.FINAL_ONLY, max_tokens=200)
    engine.add_request(prompts[0], params, request_id="ab")
    for _ in range(6):
        assert engine.step() == []  # running: nothing handed over yet
    out = engine.abort("ab")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.new_token_ids == out.token_ids and len(out.token_ids) >= 4
    assert not engine.has_unfinished_requests()


def test_without_detokenizing_the_tokens_are_the_same_and_the_text_empty(tiny, prompts):
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    with_text = tiny.generate(prompts, greedy)
    without = tiny.generate(prompts, dataclasses.replace(greedy, detokenize=False))
    assert [o.token_ids for o in without] == [o.token_ids for o in with_text]
    assert all(o.text for o in with_text) and not any(o.text for o in without)


def test_output_kind_and_detokenize_are_checked_on_construction():
    assert SamplingParams(output_kind="delta").output_kind is OutputKind.DELTA
    with pytest.raises(ValueError, match="output_kind must be one of cumulative, delta, "
                                         "final_only, got 'partial'"):
        SamplingParams(output_kind="partial")
    with pytest.raises(ValueError, match="stop strings need detokenize=True"):
        SamplingParams(stop=("x",), detokenize=False)
    with pytest.raises(ValueError, match="detokenize must be true or false, got 1"):
        SamplingParams(detokenize=1)

"""Structured output (SamplingParams.structured_output, xgrammar's token masks): every output
satisfies its constraint — a JSON schema, any JSON object, a regex, a choice — batched with
unconstrained requests whose outputs do not change, under async scheduling as synchronously,
with every matcher dropped at the end; a constraint the compiler cannot express is refused."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from engine.config import CacheConfig, EngineConfig
from engine.engine import LLMEngine
from engine.llm import LLM
from engine.request import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "sure"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}}}
CONSTRAINTS = [StructuredOutput("json_schema", json.dumps(SCHEMA)),
               StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4}"),
               StructuredOutput("choice", json.dumps(["red", "green", "blue"])),
               StructuredOutput("json_object")]


def satisfied(constraint: StructuredOutput, text: str) -> bool:
    if constraint.kind == "json_schema":
        jsonschema.validate(json.loads(text), SCHEMA)
        return True
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    if constraint.kind == "choice":
        return text in json.loads(constraint.spec)
    return isinstance(json.loads(text), dict)


@pytest.fixture(scope="module")
def smol(default_model_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(default_model_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=256)))


def test_each_constraint_holds_beside_unconstrained_requests(smol, workload_prompts):
    chat = smol.tokenizer.encode_chat([{"role": "user", "content": "Is the sky blue? Answer."}])
    plain = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    params = [SamplingParams(temperature=0, max_tokens=80, structured_output=c)
              for c in CONSTRAINTS]
    params.append(SamplingParams(temperature=0.9, seed=4, max_tokens=80,
                                 structured_output=CONSTRAINTS[0]))
    prompts = [chat] * len(params) + [workload_prompts[1][:40]]
    outs = smol.generate(prompts, params + [plain])
    for out, p in zip(outs, params):
        assert out.finish_reason == "stop", out.text  # the constraint completed, then EOS
        assert satisfied(p.structured_output, out.text), out.text
    assert outs[-1].token_ids == smol.generate([prompts[-1]], plain)[0].token_ids
    assert len(smol.engine.runner.grammars) == 0  # every matcher dropped


def test_a_constraint_the_compiler_cannot_express_is_refused(smol):
    for constraint, words in ((StructuredOutput("regex", "[a-"), "Unclosed '['"),
                              (StructuredOutput("json_schema", '{"type": "nonsense"}'),
                               'Unsupported type "nonsense"')):
        with pytest.raises(ValueError, match=re.escape(words)):
            smol.engine.add_request([1, 2, 3], SamplingParams(structured_output=constraint))
    with pytest.raises(ValueError, match="choice must be a non-empty list"):
        StructuredOutput("choice", "[]")


def test_choices_beyond_ascii_min_tokens_and_a_rejected_token(smol):
    choices = ["\U0001F600 yes", "n\u00e9e"]
    out = smol.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=20,
        structured_output=StructuredOutput("choice", json.dumps(choices))))[0]
    assert out.text in choices and out.finish_reason == "stop"
    with pytest.raises(ValueError, match="min_tokens cannot be combined"):
        SamplingParams(min_tokens=2, structured_output=CONSTRAINTS[3])
    book = smol.engine.runner.grammars  # a token the constraint forbids: False, matcher gone
    request = smol.engine.new_request([1, 2], SamplingParams(structured_output=CONSTRAINTS[1]),
                                      "x")
    assert not book.accept(request, smol.tokenizer.encode("abc")[0]) and len(book) == 0


def test_constrained_requests_step_synchronously_under_async_scheduling(tiny_llama_dir):
    """The tiny model (its random weights leave the grammar to choose every token's set): the
    default model's two loads made this the suite's second-slowest test."""
    outputs = []
    for on in (False, True):
        engine = LLMEngine(EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                        async_scheduling=on, cache=CacheConfig(num_blocks=64)))
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(temperature=0, max_tokens=9,
                                                           ignore_eos=True), request_id="free")
        done = {}
        for step in range(200):
            if step == 3:  # a constrained request arrives while a step is in flight
                engine.add_request([6, 7, 8], SamplingParams(
                    temperature=0, max_tokens=60, structured_output=CONSTRAINTS[0]),
                    request_id="json")
            done.update({o.request_id: o for o in engine.step() if o.finished})
            if not engine.has_unfinished_requests():
                break
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        # the grammar chose the tokens: a whole object matching the schema, ended by the grammar
        assert done["json"].finish_reason == "stop"
        assert satisfied(CONSTRAINTS[0], engine.tokenizer.decode(done["json"].token_ids))
        outputs.append({rid: o.token_ids for rid, o in done.items()})
    assert outputs[0] == outputs[1]

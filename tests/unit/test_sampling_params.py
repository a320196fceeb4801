from __future__ import annotations

import math

import pytest

from engine.request import SamplingParams


@pytest.mark.parametrize(
    ("kwargs", "field", "limit"),
    [
        ({"max_tokens": 0}, "max_tokens", ">= 1"),
        ({"max_tokens": -3}, "max_tokens", ">= 1"),
        ({"temperature": -0.1}, "temperature", ">= 0"),
        ({"temperature": math.nan}, "temperature", ">= 0"),
        ({"temperature": math.inf}, "temperature", "finite"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.5}, "top_p", "(0, 1]"),
        ({"top_p": math.nan}, "top_p", "(0, 1]"),
        ({"top_k": 0}, "top_k", "-1"),
        ({"top_k": -2}, "top_k", "-1"),
        ({"top_k": 2.5}, "top_k", "integer"),
        ({"logprobs": 21}, "logprobs", "[0, 20]"),
        ({"seed": -1}, "seed", "[0, 2**64)"),
        ({"seed": 2**64}, "seed", "[0, 2**64)"),
        ({"stop": ("",)}, "stop", "non-empty"),
    ],
)
def test_bad_sampling_params_name_field_and_limit(kwargs, field, limit):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert field in str(err.value) and limit in str(err.value)


def test_valid_params_and_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=[5, 6], temperature=0)
    assert p.stop == ("###",) and p.stop_token_ids == (5, 6) and p.greedy
    assert not SamplingParams(temperature=0.7, top_k=-1, top_p=1.0).greedy


def test_numeric_fields_are_stored_as_floats():
    """What passes validation as a number is kept as one: the sampler turns these into float
    tensors, and a string "0" must not read as a temperature other than 0 there."""
    p = SamplingParams(temperature="0", top_p=1, presence_penalty=1, frequency_penalty="-0.5",
                       repetition_penalty=1)
    floats = (p.temperature, p.top_p, p.presence_penalty, p.frequency_penalty,
              p.repetition_penalty)
    assert floats == (0.0, 1.0, 1.0, -0.5, 1.0)
    assert all(type(v) is float for v in floats)
    assert p.greedy and p.penalizes_history

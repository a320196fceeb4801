"""serving.worker_params: a worker's engine streams deltas, and builds text only when a stop
string must be found in it."""

from __future__ import annotations

from engine.request import OutputKind, SamplingParams
from serving.worker_params import worker_params


def test_a_worker_streams_deltas_and_builds_no_text_it_does_not_need():
    asked = SamplingParams(max_tokens=7, temperature=0.5, logprobs=2)
    served = worker_params(asked)
    assert served.output_kind is OutputKind.DELTA and served.detokenize is False
    assert (served.max_tokens, served.temperature, served.logprobs) == (7, 0.5, 2)
    assert asked.output_kind is OutputKind.CUMULATIVE and asked.detokenize  # left as it was
    assert worker_params(served) is served


def test_stop_strings_keep_the_text():
    served = worker_params(SamplingParams(stop=("\n\n",)))
    assert served.detokenize and served.output_kind is OutputKind.DELTA
    assert served.stop == ("\n\n",)

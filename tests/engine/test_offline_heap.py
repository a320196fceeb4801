"""The offline API's runs on the tiny model: while `generate` or `stream` runs, no full collection
walks what existed before it (engine.gc_heap), and everything is the collector's again after, on
every way a run ends."""

from __future__ import annotations

import gc

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir) -> LLM:
    return LLM(config=EngineConfig(model=str(tiny_llama_dir), dtype="float32",
                                   cache=CacheConfig(num_blocks=64)))


def walked(obj: object) -> bool:
    """Whether a full collection would walk `obj` (frozen objects are not in get_objects)."""
    return any(o is obj for o in gc.get_objects())


def test_a_run_hides_the_heap_from_the_collector_and_gives_it_back(tiny, workload_prompts):
    before = [[]]
    frozen_before = gc.get_freeze_count()
    seen = []
    for _ in tiny.stream(workload_prompts[:2], PARAMS):
        seen.append(walked(before))
    assert seen and not any(seen)  # every step ran with the older heap frozen
    assert walked(before) and gc.get_freeze_count() == frozen_before
    outputs = tiny.generate(workload_prompts[:2], PARAMS)
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    assert walked(before) and gc.get_freeze_count() == frozen_before


def test_a_stream_dropped_early_or_failing_thaws_the_heap(tiny, workload_prompts):
    frozen_before = gc.get_freeze_count()
    stream = tiny.stream(workload_prompts[:2], PARAMS)
    next(stream)
    assert gc.get_freeze_count() > frozen_before
    stream.close()  # a consumer that stops early
    assert gc.get_freeze_count() == frozen_before
    assert not tiny.engine.has_unfinished_requests()

    def broken_step() -> list:
        raise RuntimeError("the step failed")

    tiny.engine.step = broken_step
    try:
        with pytest.raises(RuntimeError, match="the step failed"):
            tiny.generate(workload_prompts[:1], PARAMS)
    finally:
        del tiny.engine.step  # the class's own again
    assert gc.get_freeze_count() == frozen_before

"""The offline API's runs on the tiny model: while `generate` or `stream` runs, no full collection
walks what existed before it (engine.gc_heap), and everything is the collector's again after, on
every way a run ends."""

from __future__ import annotations

import gc
import weakref

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


def _observed(tiny: LLM, before: object, seen: list[bool]) -> None:
    """Record, at every engine step, whether a full collection would walk `before`."""
    step = tiny.engine.step

    def observed_step() -> list:
        seen.append(walked(before))
        return step()

    tiny.engine.step = observed_step


def test_a_step_hides_the_heap_from_the_collector_and_gives_it_back(tiny, workload_prompts):
    before = [[]]
    assert gc.get_freeze_count() == 0  # nothing in this process froze the heap for good
    seen: list[bool] = []
    _observed(tiny, before, seen)
    try:
        for _ in tiny.stream(workload_prompts[:2], PARAMS):
            # nothing frozen while the consumer holds the stream
            assert walked(before) and gc.get_freeze_count() == 0
        assert seen and not any(seen)  # every step ran with the older heap frozen
        steps = len(seen)
        outputs = tiny.generate(workload_prompts[:2], PARAMS)
        assert len(seen) > steps and not any(seen)
    finally:
        del tiny.engine.step  # the class's own again
    assert [len(o.token_ids) for o in outputs] == [6, 6]
    assert walked(before) and gc.get_freeze_count() == 0


def test_a_stream_dropped_early_or_failing_thaws_the_heap(tiny, workload_prompts):
    stream = tiny.stream(workload_prompts[:2], PARAMS)
    next(stream)
    assert tiny.engine.has_unfinished_requests()
    stream.close()  # a consumer that stops early
    assert gc.get_freeze_count() == 0
    assert not tiny.engine.has_unfinished_requests()

    def broken_step() -> list:
        raise RuntimeError("the step failed")

    tiny.engine.step = broken_step
    try:
        with pytest.raises(RuntimeError, match="the step failed"):
            tiny.generate(workload_prompts[:1], PARAMS)
    finally:
        del tiny.engine.step  # the class's own again
    assert gc.get_freeze_count() == 0


class _Holder:
    """A consumer that refers to itself (a callback bound to it): when dropped, only the cyclic
    collector frees it, and the stream it holds with it."""

    def __init__(self, stream: object) -> None:
        self.stream = stream
        self.on_done = self.done

    def done(self) -> None:
        pass


def test_a_stream_abandoned_in_a_reference_cycle_is_collected_and_frees_its_blocks(
        tiny, workload_prompts):
    free_before = tiny.engine.block_manager.num_free_blocks
    holder = _Holder(tiny.stream(workload_prompts[:2], PARAMS))
    next(holder.stream)  # started: its requests hold KV blocks
    stream = weakref.ref(holder.stream)
    del holder
    gc.collect()
    assert stream() is None  # collected, so its finally ran
    assert not tiny.engine.has_unfinished_requests()
    assert tiny.engine.block_manager.num_free_blocks == free_before
    assert gc.get_freeze_count() == 0

"""300 requests with random aborts at random points: every block comes back."""

from __future__ import annotations

import random

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams


def test_300_requests_with_random_aborts_leak_no_block(tiny_llama_dir, workload_prompts):
    engine = LLMEngine(EngineConfig(
        model=str(tiny_llama_dir), dtype="float32", cache=CacheConfig(num_blocks=48),
        scheduler=SchedulerConfig(max_num_batched_tokens=128, max_num_seqs=16,
                                  prefill_chunk_size=48),
    ))
    bm = engine.block_manager
    start_free = bm.num_free_blocks
    rng = random.Random(0)
    live: list[str] = []
    finished = aborted = 0
    for n in range(300):
        prompt = workload_prompts[rng.randrange(len(workload_prompts))][: rng.randint(1, 120)]
        params = SamplingParams(max_tokens=rng.randint(1, 24),
                                temperature=rng.choice([0.0, 0.8]), seed=rng.choice([None, n]))
        live.append(engine.add_request(prompt, params))
        for _ in range(rng.randint(0, 2)):
            finished += sum(o.finished for o in engine.step())
            bm.check_integrity(list(engine.scheduler.all_requests()))
        if rng.random() < 0.5 and live:
            victim = live.pop(rng.randrange(len(live)))
            out = engine.abort(victim)
            aborted += out is not None
    while engine.has_unfinished_requests():
        finished += sum(o.finished for o in engine.step())
    assert aborted >= 25 and finished + aborted == 300
    assert engine.scheduler.num_preemptions > 0
    usage = bm.usage()
    assert usage.used == 0 and bm.num_free_blocks == start_free == 48

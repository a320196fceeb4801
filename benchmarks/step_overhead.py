"""Scheduler + batch-preparation CPU time per step, and KV-cache waste, at N running sequences.

    python -m benchmarks.step_overhead [--running 64] [--steps 30] [--dtype float32]

Fills the engine with N decoding requests (real prompts from the shared workload), then times each
step's phases separately: schedule, batch preparation (host tensors + attention plan), the model
forward + sampling, and update. Reports medians and the bookkeeping share of the step. KV waste is
allocated-but-unused slots over allocated slots of the running requests (PagedAttention's measure).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from loadtest.workloads import OFFLINE_MIXED

WORKLOAD = OFFLINE_MIXED


def kv_waste(engine: LLMEngine) -> float:
    bs = engine.block_manager.block_size
    running = engine.scheduler.running
    allocated = sum(len(r.block_ids) * bs for r in running)
    used = sum(r.num_computed_tokens for r in running)
    return 1.0 - used / allocated if allocated else 0.0


def fill(engine: LLMEngine, running: int, max_tokens: int) -> None:
    rows = [json.loads(line) for line in WORKLOAD.open()]
    for i in range(running):
        prompt = rows[i % len(rows)]["prompt_token_ids"]
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                  ignore_eos=True))
    while engine.scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                          for r in engine.scheduler.running):
        engine.step()


def timed_step(engine: LLMEngine) -> dict[str, float]:
    clock = time.perf_counter
    t0 = clock()
    out = engine.scheduler.schedule()
    t1 = clock()
    prepared = engine.runner.prepare_inputs(out)
    t2 = clock()
    result = engine.runner.run(prepared)
    t3 = clock()
    engine.scheduler.update(out, result.sampled, result.logprobs)
    t4 = clock()
    return {"schedule": t1 - t0, "prepare": t2 - t1, "forward_sample": t3 - t2,
            "update": t4 - t3, "total": t4 - t0, "seqs": len(out.scheduled)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(
        dtype=args.dtype, cache=CacheConfig(kv_cache_gb=2.0),
        scheduler=SchedulerConfig(max_num_seqs=args.running,
                                  max_num_batched_tokens=max(2048, args.running)),
    ))
    fill(engine, args.running, max_tokens=args.steps + 8)
    samples, wastes = [], []
    for _ in range(args.steps):
        samples.append(timed_step(engine))
        wastes.append(kv_waste(engine))
    assert all(s["seqs"] == args.running for s in samples), "not all sequences were decoding"
    med = {k: statistics.median(s[k] for s in samples) for k in samples[0]}
    book = med["schedule"] + med["prepare"] + med["update"]
    print(f"running sequences: {args.running}, steps: {args.steps}, dtype: {args.dtype}")
    for key in ("schedule", "prepare", "forward_sample", "update", "total"):
        print(f"  {key:15s} median {med[key] * 1e3:8.2f} ms")
    print(f"  bookkeeping (schedule + prepare + update) share of step: {book / med['total']:.1%}")
    print(f"  KV waste (allocated but unused slots), median over steps: "
          f"{statistics.median(wastes):.2%}")


if __name__ == "__main__":
    main()

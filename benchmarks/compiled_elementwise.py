"""Does `torch.compile` of the decoder layer's element-wise functions (RMSNorm, RoPE) pay on
CPU? Decode steps of the default model at N running sequences, alternating eager and compiled
step by step in one process (so drift hits both alike); medians and their ratio.

    python -m benchmarks.compiled_elementwise [--running 64] [--steps 40] [--dtype float32]

The compiled functions are swapped into engine.models.llama for the compiled steps only; the
first compiled steps (compilation) are not timed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

import engine.models.llama as llama
from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine


def timed_decode_step(engine: LLMEngine) -> float:
    out = engine.scheduler.schedule()
    start = time.perf_counter()
    result = engine.runner.execute(out)
    elapsed = time.perf_counter() - start
    engine.scheduler.update(out, result.sampled, result.logprobs)
    return elapsed


def swap(functions: dict[str, Callable]) -> None:
    for name, fn in functions.items():
        setattr(llama, name, fn)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each form")
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    eager = {"rms_norm": llama.rms_norm, "apply_rope": llama.apply_rope}
    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in eager.items()}
    engine = LLMEngine(EngineConfig(
        dtype=args.dtype, cache=CacheConfig(kv_cache_gb=2.0),
        scheduler=SchedulerConfig(max_num_seqs=args.running,
                                  max_num_batched_tokens=max(2048, args.running))))
    fill(engine, args.running, max_tokens=2 * args.steps + 16)
    swap(compiled)
    start = time.perf_counter()
    for _ in range(3):
        timed_decode_step(engine)
    compile_s = time.perf_counter() - start
    times: dict[str, list[float]] = {"eager": [], "compiled": []}
    for i in range(2 * args.steps):
        form = "compiled" if i % 2 else "eager"
        swap(compiled if form == "compiled" else eager)
        times[form].append(timed_decode_step(engine))
    swap(eager)
    med = {form: statistics.median(t) for form, t in times.items()}
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {args.running} sequences decoding, "
          f"{args.dtype}, {args.steps} steps each")
    print(f"  compile (first 3 steps) {compile_s:.1f} s")
    for form, value in med.items():
        print(f"  {form:9s} forward + sample median {value * 1e3:8.2f} ms")
    print(f"  speed-up compiled vs eager: {med['eager'] / med['compiled']:.3f}x")


if __name__ == "__main__":
    main()

"""The sampler's argmax inside real decode steps: torch's `argmax` against `engine.row_argmax`,
swapped step by step in one engine so both see the same host, batch and contexts.

    python -m benchmarks.argmax_forms [--running 8,32,64,128] [--dtypes float32,bfloat16]
        [--rounds 15] [--steps 3]

Per dtype and running count: the median step and the median time inside `Sampler.sample`, over
`rounds` x `steps` steps of each form (each round runs every form once, a warm-up step first).
Greedy rows, EOS ignored, the offline workload's prompts (benchmarks.step_overhead.fill).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

import engine.sampler as sampler_module
from benchmarks.step_breakdown import Clock
from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.row_argmax import row_argmax

FORMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "torch": lambda x: x.argmax(dim=-1), "row_argmax": row_argmax}


def measure(dtype: str, running: int, rounds: int, steps: int) -> dict[str, tuple[float, float]]:
    """{form: (median step ms, median sampler ms)}."""
    engine = LLMEngine(EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_gb=2.0),
                                    scheduler=SchedulerConfig(max_num_seqs=running,
                                                              max_num_batched_tokens=512)))
    fill(engine, running, max_tokens=rounds * (steps + 1) * len(FORMS) + 8)
    clock = Clock()
    engine.runner.sampler.sample = clock.wrap("sampler", engine.runner.sampler.sample)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in FORMS}
    try:
        for _ in range(rounds):
            for name, form in FORMS.items():
                sampler_module.row_argmax = form  # what Sampler.sample calls
                engine.step()
                for _ in range(steps):
                    clock.spent.clear()
                    start = time.perf_counter()
                    engine.step()
                    times[name][0].append(time.perf_counter() - start)
                    times[name][1].append(clock.spent["sampler"])
    finally:
        sampler_module.row_argmax = row_argmax
    return {name: (statistics.median(s) * 1e3, statistics.median(p) * 1e3)
            for name, (s, p) in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="8,32,64,128")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args(argv)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; medians of {args.rounds} x {args.steps} steps per form")
    print("| dtype | running | step ms: torch / row_argmax | sampler ms: torch / row_argmax |")
    print("|---|---|---|---|")
    for dtype in args.dtypes.split(","):
        for running in (int(r) for r in args.running.split(",")):
            got = measure(dtype, running, args.rounds, args.steps)
            (step_t, samp_t), (step_r, samp_r) = got["torch"], got["row_argmax"]
            print(f"| {dtype} | {running} | {step_t:.1f} / {step_r:.1f} | "
                  f"{samp_t:.2f} / {samp_r:.2f} |", flush=True)


if __name__ == "__main__":
    main()

"""A float32 decode step's linears through oneDNN and through the few-row GEMM
(engine/models/csrc/cpu_small_gemm.cpp), side by side on CPU: decode steps of the default model at
each N running sequences, the two forms alternating step by step in one engine (so drift hits
both alike); median step times and their ratio.

    python -m benchmarks.small_gemm_forms [--running 1,8,16,24,32] [--steps 20]

The kernel is built here whatever the machine (it needs AVX2 and FMA); the engine's own policy
(engine.models.cpu_small_gemm) decides where it is used by default.
"""

from __future__ import annotations

import argparse
import platform
import statistics

import torch

from benchmarks.elementwise_forms import timed_decode_step
from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models import linear as linear_module
from engine.models.cpu_small_gemm import build_small_gemm
from engine.models.linear import Linear


def linears(engine: LLMEngine) -> list[Linear]:
    found = [lin for layer in engine.runner.model.layers
             for lin in vars(layer).values() if isinstance(lin, Linear)]
    return [*found, engine.runner.model.lm_head]


def measure(running: int, steps: int) -> dict[str, float]:
    """Median seconds of a decode step at `running` sequences: oneDNN's and the kernel's."""
    native = build_small_gemm()
    if native is None:
        raise SystemExit("the few-row GEMM does not build here (it needs AVX2 and FMA)")
    linear_module.load_cpu_small_gemm = lambda: native  # this engine packs for both forms
    engine = LLMEngine(EngineConfig(
        dtype="float32", cache=CacheConfig(kv_cache_gb=1.0),
        scheduler=SchedulerConfig(max_num_seqs=running,
                                  max_num_batched_tokens=max(512, running))))
    layers = linears(engine)
    packed = [lin.small_rows for lin in layers]
    forms = {"onednn": [None] * len(layers), "kernel": packed}
    fill(engine, running, max_tokens=3 * steps + 16)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for i in range(2 * steps + 4):
        name = list(forms)[i % 2]
        for lin, small in zip(layers, forms[name]):
            lin.small_rows = small
        elapsed = timed_decode_step(engine)
        if i >= 4:  # the first steps of each form (first touch) are not timed
            times[name].append(elapsed)
    for request in list(engine.scheduler.all_requests()):
        engine.abort(request.request_id)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="1,8,16,24,32")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each form")
    args = parser.parse_args()
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; float32 decode steps, {args.steps} each")
    print("| running | oneDNN ms | few-row GEMM ms | oneDNN / kernel |")
    print("|---|---|---|---|")
    for running in (int(n) for n in args.running.split(",")):
        med = measure(running, args.steps)
        print(f"| {running} | {med['onednn'] * 1e3:.1f} | {med['kernel'] * 1e3:.1f} | "
              f"{med['onednn'] / med['kernel']:.2f}x |", flush=True)


if __name__ == "__main__":
    main()

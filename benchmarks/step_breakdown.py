"""Where an engine step's time goes on CPU: decode steps at N running sequences (and a 512-token
prefill step), split into bookkeeping (schedule + update), batch preparation, linears, attention
(KV write included), element-wise chains, sampling and the rest of the forward (embedding,
residual adds, final norm, glue), per dtype.

    python -m benchmarks.step_breakdown [--running 8,64,128] [--dtypes bfloat16,float32]
        [--steps 20] [--json OUT]

Each part is timed by wrapping the engine's own callables (Linear, the attention backend, the
element-wise form, the sampler) with a clock; the CPU forward is synchronous, so wall time is the
part's cost. The wrappers add ~1 us per call (~200 calls a step): small beside the step. Medians
over `--steps` steps; shares are of the median step.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models.linear import Linear
from engine.request import SamplingParams

PARTS = ("bookkeeping", "prepare", "linears", "attention", "element-wise", "sampler",
         "other forward")


class Clock:
    """Accumulates wall time per part while a step runs."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[part] += time.perf_counter() - start
        return timed


def instrument(engine: LLMEngine, clock: Clock) -> None:
    """Wrap this engine's parts; the class-level ones (Linear, the attention backend) once per
    process, reporting to `clock` through CLOCKS."""
    runner = engine.runner
    ops = runner.model.elementwise
    for name in ("add_rms_norm", "rope_qkv", "silu_mul"):
        setattr(ops, name, clock.wrap("element-wise", getattr(ops, name)))
    runner.sampler.sample = clock.wrap("sampler", runner.sampler.sample)
    runner.attention.write_kv = clock.wrap("attention", runner.attention.write_kv)
    CLOCKS[:] = [clock]
    for cls, part in ((Linear, "linears"), (type(runner.attention), "attention")):
        if cls not in WRAPPED:
            WRAPPED.add(cls)
            cls.__call__ = _current_clock_wrap(part, cls.__call__)


CLOCKS: list[Clock] = []
WRAPPED: set[type] = set()


def _current_clock_wrap(part: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            CLOCKS[0].spent[part] += time.perf_counter() - start
    return timed


def timed_step(engine: LLMEngine, clock: Clock) -> dict[str, float]:
    clock.spent.clear()
    t0 = time.perf_counter()
    out = engine.scheduler.schedule()
    t1 = time.perf_counter()
    prepared = engine.runner.prepare_inputs(out)
    t2 = time.perf_counter()
    result = engine.runner.run(prepared)
    t3 = time.perf_counter()
    engine.scheduler.update(out, result.sampled, result.logprobs)
    t4 = time.perf_counter()
    parts = {"bookkeeping": (t1 - t0) + (t4 - t3), "prepare": t2 - t1}
    parts.update({p: clock.spent.get(p, 0.0) for p in PARTS[2:6]})
    parts["other forward"] = (t3 - t2) - sum(clock.spent.values())
    parts["step"] = t4 - t0
    return parts


def summarize(steps: list[dict[str, float]]) -> dict[str, float]:
    return {part: statistics.median(s[part] for s in steps) * 1e3 for part in (*PARTS, "step")}


def measure(dtype: str, running: int, steps: int) -> dict[str, dict[str, float]]:
    engine = LLMEngine(EngineConfig(
        dtype=dtype, cache=CacheConfig(kv_cache_gb=2.0),
        scheduler=SchedulerConfig(max_num_seqs=max(running, 1),
                                  max_num_batched_tokens=max(512, running))))
    clock = Clock()
    fill(engine, running, max_tokens=steps + 8)
    instrument(engine, clock)
    for _ in range(2):
        timed_step(engine, clock)
    result = {f"decode, {running} running": summarize(
        [timed_step(engine, clock) for _ in range(steps)])}
    for request in list(engine.scheduler.all_requests()):
        engine.abort(request.request_id)
    prefills = []
    for i in range(5):  # a fresh 512-token prompt alone: one full-budget prefill step
        engine.add_request([9000 + i] * 512, SamplingParams(temperature=0, max_tokens=1))
        prefills.append(timed_step(engine, clock))
        while engine.has_unfinished_requests():
            engine.step()
    result["prefill, 512 tokens"] = summarize(prefills[1:])
    return result


def table(rows: dict[str, dict[str, float]]) -> str:
    lines = ["| dtype, step | step ms | " + " | ".join(PARTS) + " |",
             "|---|---|" + "---|" * len(PARTS)]
    for name, parts in rows.items():
        step = parts["step"]
        cells = [f"{parts[p]:.1f} ({parts[p] / step:.0%})" for p in PARTS]
        lines.append(f"| {name} | {step:.1f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="8,64,128")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows: dict[str, dict[str, float]] = {}
    for dtype in args.dtypes.split(","):
        for i, running in enumerate(int(n) for n in args.running.split(",")):
            measured = measure(dtype, running, args.steps)
            for name, parts in measured.items():
                if name.startswith("decode") or i == 0:
                    rows[f"{dtype}, {name}"] = parts
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; ms per step (median of {args.steps}), share")
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

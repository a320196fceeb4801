"""Where a whole offline workload's wall time goes: every engine step of one `LLM.stream` run,
grouped into steps that carry prompt tokens and decode-only steps by how many sequences they
decode, with the time, steps and tokens of each group.

    python -m benchmarks.workload_timeline [--workload loadtest/workloads/offline_mixed.jsonl]
        [--dtypes float32,bfloat16] [--json OUT]

It answers whether scheduling can still buy throughput: a decode-only step of a few sequences
reads every weight once for a handful of tokens (memory-bound), and the workload's longest
output fixes how many steps there must be at least.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from typing import Any

import torch

from benchmarks.common import load_workload
from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams
from engine.scheduler import SchedulerOutput

GROUPS = ("with prompt tokens", "decode-only, 1-8", "decode-only, 9-32", "decode-only, 33-64",
          "decode-only, >64")


def group_of(out: SchedulerOutput) -> str:
    if any(not item.samples or item.num_tokens > 1 for item in out.scheduled):
        return GROUPS[0]
    n = len(out.scheduled)
    return GROUPS[1] if n <= 8 else GROUPS[2] if n <= 32 else GROUPS[3] if n <= 64 else GROUPS[4]


def trace(llm: LLM, rows: list[dict[str, Any]]) -> list[tuple[str, int, float]]:
    """(group, batched tokens, seconds) of every step of one run of the workload."""
    engine = llm.engine
    schedule = engine.scheduler.schedule
    steps: list[tuple[str, int, float]] = []
    last: list[SchedulerOutput] = []

    def recording() -> SchedulerOutput:
        out = schedule()
        last[:] = [out]
        return out

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    prompts = [r["prompt_token_ids"] for r in rows]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in rows]
    stream = llm.stream(prompts, params)
    while True:
        start = time.perf_counter()
        if next(stream, None) is None:
            break
        if last and not last[0].is_empty:
            steps.append((group_of(last[0]), last[0].num_batched_tokens,
                          time.perf_counter() - start))
        last.clear()
    engine.scheduler.schedule = schedule  # type: ignore[method-assign]
    return steps


def summarize(steps: list[tuple[str, int, float]]) -> dict[str, dict[str, float]]:
    total = sum(s for _, _, s in steps)
    rows: dict[str, dict[str, float]] = {}
    for group in GROUPS:
        mine = [(n, s) for g, n, s in steps if g == group]
        if mine:
            seconds = sum(s for _, s in mine)
            rows[group] = {"steps": len(mine), "tokens": sum(n for n, _ in mine),
                           "seconds": seconds, "share": seconds / total,
                           "ms_per_step": 1e3 * seconds / len(mine)}
    rows["all"] = {"steps": len(steps), "tokens": sum(n for _, n, _ in steps), "seconds": total,
                   "share": 1.0, "ms_per_step": 1e3 * total / max(1, len(steps))}
    return rows


def table(results: dict[str, dict[str, dict[str, float]]]) -> str:
    lines = ["| dtype | steps | count | tokens | seconds | share of wall time | ms per step |",
             "|---|---|---|---|---|---|---|"]
    for dtype, rows in results.items():
        for group, r in rows.items():
            lines.append(f"| {dtype} | {group} | {r['steps']:.0f} | {r['tokens']:,.0f} | "
                         f"{r['seconds']:.2f} | {r['share']:.0%} | {r['ms_per_step']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="loadtest/workloads/offline_mixed.jsonl")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    rows = load_workload(args.workload)
    results = {}
    for dtype in args.dtypes.split(","):
        llm = LLM(config=EngineConfig(model="default", dtype=dtype))
        trace(llm, rows[:2])  # warm-up: oneDNN primitives, page faults
        llm.engine.block_manager.reset_prefix_cache()
        results[dtype] = summarize(trace(llm, rows))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; workload {args.workload}")
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""The engine under test: every request submitted at once through `LLM.stream`, timed per token."""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from benchmarks.common import Row, latency_stats, summarize_runs

WARMUP_TOKENS = 8


def run_ours(rows: list[Row], dtype: str, runs: int) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    load_start = time.perf_counter()
    llm = LLM(config=EngineConfig(model="default", dtype=dtype))
    load_s = time.perf_counter() - load_start
    warm = [rows[0]["prompt_token_ids"][:32]]
    llm.generate(warm, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS, ignore_eos=True))
    results = [_run_once(llm, rows) for _ in range(runs)]
    extra = {
        "load_s": load_s,
        "engine_dtype": str(llm.engine.dtype),
    }
    return summarize_runs("ours", dtype, results, extra)


def _run_once(llm: Any, rows: list[Row]) -> dict[str, Any]:
    from engine.request import SamplingParams

    _reset_prefix_cache(llm)  # every run starts cold: no prompt blocks cached by the previous run
    prompts = [r["prompt_token_ids"] for r in rows]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=r["ignore_eos"])
              for r in rows]
    token_times: dict[str, list[float]] = {}
    finished: dict[str, Any] = {}
    start = time.perf_counter()
    for step in llm.stream(prompts, params):
        now = time.perf_counter()
        for out in step:
            token_times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
            if out.finished:
                finished[out.request_id] = out
    elapsed = time.perf_counter() - start
    useful = sum(len(out.token_ids) for out in finished.values())
    return {
        "tokens": useful,
        "seconds": elapsed,
        "tok_s": useful / elapsed,
        "latency": latency_stats(token_times, start),
        "cached_prompt_tokens": sum(out.num_cached_tokens for out in finished.values()),
        "length_mismatches": _mismatches(rows, finished.values()),
    }


def _mismatches(rows: list[Row], outputs: Any) -> int:
    """How many (prompt, generated length) pairs differ from the workload's (prompt, max_tokens)."""
    expected = Counter((tuple(r["prompt_token_ids"]), r["max_tokens"]) for r in rows)
    got = Counter((tuple(o.prompt_token_ids), len(o.token_ids)) for o in outputs)
    return sum((expected - got).values()) + sum((got - expected).values())


def _reset_prefix_cache(llm: Any) -> None:
    block_manager = getattr(llm.engine, "block_manager", None)
    reset = getattr(block_manager, "reset_prefix_cache", None)
    if callable(reset):
        reset()

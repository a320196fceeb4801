"""GPU engine speed (issue 15): ours eager, with async scheduling, with CUDA graphs, with both,
and with both + fused element-wise kernels, beside transformers' `generate` (static batches of
32) and `generate_batch` (its continuous batching), on random-weight checkpoints of three model
shapes, in one run; and the GPU busy share of each of ours (kernel time / wall time under
torch.profiler, and that kernel time over the same work's wall time unprofiled: the profiler
slows the host, which paces the smaller shapes).

    python -m benchmarks.gpu_engine --tokenizer DIR [--shapes smol135m,llama1b[,llama8b]]
        [--requests 256] [--runs 2] [--systems ...] [--peer-requests N] [--json OUT.json]

The workload is `offline_mixed.jsonl` repeated to --requests, each prompt given a distinct first
token (no request shares a cached prefix with another), greedy, EOS ignored: 256 requests are
71,208 prompt + 18,688 output tokens. Ours runs with 256 sequences and an 8,192-token budget.
tok/s counts each request's own output tokens over the whole workload's wall time, except
generate_batch, which runs every request to the longest max_tokens (its tok/s counts what it
generated); with --peer-requests N, transformers' systems run the first N requests. Every pass of
ours gives each prompt a first token no earlier pass used, so no pass is served from the prefix
cache. `first_run_s` is ours' first pass (where any compilation after start would show).

`--device cpu --shapes tiny --requests 4` is a smoke run (the unit test's); no busy share there.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import DEFAULT_WORKLOAD
from benchmarks.gpu_clocks import GpuClockSampler
from benchmarks.random_checkpoint import SHAPES, write_checkpoint

OFF = {"cuda_graphs": False, "async_scheduling": False, "fused_kernels": False}
OURS = {"ours_eager": OFF, "ours_async": {**OFF, "async_scheduling": True},
        "ours_graphs": {**OFF, "cuda_graphs": True},
        "ours_graphs_async": {**OFF, "cuda_graphs": True, "async_scheduling": True},
        "ours_graphs_async_fused": {"cuda_graphs": True, "async_scheduling": True,
                                    "fused_kernels": True}}
PEERS = ("hf_static", "hf_generate_batch")
STATIC_BATCH = 32


def workload(path: str, requests: int, max_tokens_cap: int | None = None
             ) -> list[dict[str, Any]]:
    rows = [json.loads(line) for line in Path(path).open()]
    cap = max_tokens_cap or max(r["max_tokens"] for r in rows)
    return [{"prompt_token_ids": [1000 + i] + rows[i % len(rows)]["prompt_token_ids"],
             "max_tokens": min(cap, rows[i % len(rows)]["max_tokens"])} for i in range(requests)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_ours(name: str, model_dir: Path, rows: list[dict[str, Any]], args: argparse.Namespace
             ) -> dict[str, Any]:
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    config = EngineConfig(model=str(model_dir), dtype=args.dtype, device=args.device,
                          cache=CacheConfig(kv_cache_gb=0.25 if args.device == "cpu" else None),
                          scheduler=SchedulerConfig(max_num_seqs=args.max_num_seqs,
                                                    max_num_batched_tokens=args.budget),
                          **OURS[name])
    start = time.perf_counter()
    llm = LLM(config=config)
    result: dict[str, Any] = {"start_s": time.perf_counter() - start}
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in rows]
    with GpuClockSampler(device_index=gpu_index(args.device)) as clocks:
        seconds = timed_passes(llm, rows, params, args, result)
    result["gpu_clocks"] = clocks.summary()
    tokens = sum(r["max_tokens"] for r in rows)
    result.update(first_run_s=seconds[0], seconds=seconds[1:],
                  tok_s=tokens / statistics.median(seconds[1:]))
    if args.device.startswith("cuda"):
        result["gpu_busy_share"] = gpu_busy_share(
            llm, fresh_prompts(rows, args.runs + 1)[:128], fresh_prompts(rows, args.runs + 2)[:128],
            SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    del llm
    return result


def gpu_index(device: str) -> int:
    """nvidia-smi's index of `device` ("cuda:N"; "cuda" is 0), as CUDA numbers it when
    CUDA_VISIBLE_DEVICES is unset."""
    return int(device.split(":")[1]) if ":" in device else 0


def timed_passes(llm: Any, rows: list[dict[str, Any]], params: list[Any],
                 args: argparse.Namespace, result: dict[str, Any]) -> list[float]:
    """Seconds of each pass over the workload (the first, then --runs more), each with fresh
    prompts; the first pass's first tokens go into `result`."""
    seconds = []
    for run in range(args.runs + 1):
        prompts = fresh_prompts(rows, run)
        sync(args.device)
        t = time.perf_counter()
        outputs = llm.generate(prompts, params)
        sync(args.device)
        seconds.append(time.perf_counter() - t)
        if run == 0:
            result["first_tokens"] = [o.token_ids[:8] for o in outputs[:4]]
    return seconds


def fresh_prompts(rows: list[dict[str, Any]], run: int) -> list[list[int]]:
    """The workload's prompts with first tokens no earlier pass used: every pass computes every
    prompt (the prefix cache would otherwise serve repeated passes their prompts for free)."""
    first = 1000 + run * len(rows)
    return [[first + i] + r["prompt_token_ids"][1:] for i, r in enumerate(rows)]


def gpu_busy_share(llm: Any, prompts: list[list[int]], again: list[list[int]], params: Any
                   ) -> dict[str, float]:
    """The GPU's busy share of one pass: the union of its kernel intervals over its wall time.
    The profiler also records every host op, which slows the host that paces the smaller
    shapes; so the same kernel time is also divided by the wall time of the same work run
    again without the profiler (`again`: fresh prompts of the same lengths)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        wall_s = timed_generate(llm, prompts, params)
    spans = [(e.time_range.start, e.time_range.end) for e in prof.events()
             if e.device_type.name == "CUDA"]
    busy_s = union_length(spans) / 1e6  # the profiler's times are in microseconds
    unprofiled_s = timed_generate(llm, again, params)
    return {"busy_share": busy_s / wall_s, "busy_share_unprofiled": busy_s / unprofiled_s,
            "kernels": len(spans), "wall_s": wall_s, "unprofiled_wall_s": unprofiled_s}


def timed_generate(llm: Any, prompts: list[list[int]], params: Any) -> float:
    sync("cuda")
    start = time.perf_counter()
    llm.generate(prompts, params)
    sync("cuda")
    return time.perf_counter() - start


def union_length(spans: list[tuple[float, float]]) -> float:
    """How long at least one of the (start, end) intervals is open."""
    total, end = 0.0, float("-inf")
    for lo, hi in sorted(spans):
        if hi > end:
            total += hi - max(lo, end)
            end = hi
    return total


def load_hf(model_dir: Path, args: argparse.Namespace, attn: str) -> Any:
    from transformers import AutoModelForCausalLM

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    try:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype,
                                                     attn_implementation=attn)
    except (ValueError, ImportError):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    return model.to(args.device).eval()


def run_hf_static(model_dir: Path, rows: list[dict[str, Any]], args: argparse.Namespace
                  ) -> dict[str, Any]:
    """Static batches of 32 in workload order, left-padded, each to its longest max_tokens."""
    from transformers import GenerationConfig

    model = load_hf(model_dir, args, "sdpa")

    def batch(part: list[dict[str, Any]]) -> None:
        width = max(len(r["prompt_token_ids"]) for r in part)
        ids = torch.full((len(part), width), 2, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for j, r in enumerate(part):
            n = len(r["prompt_token_ids"])
            ids[j, width - n:] = torch.tensor(r["prompt_token_ids"])
            mask[j, width - n:] = 1
        config = GenerationConfig(max_new_tokens=max(r["max_tokens"] for r in part),
                                  do_sample=False, eos_token_id=None, pad_token_id=2)
        with torch.inference_mode():
            model.generate(input_ids=ids.to(args.device), attention_mask=mask.to(args.device),
                           generation_config=config)

    batch(rows[:2])  # warm-up
    sync(args.device)
    t = time.perf_counter()
    for i in range(0, len(rows), STATIC_BATCH):
        batch(rows[i:i + STATIC_BATCH])
    sync(args.device)
    seconds = time.perf_counter() - t
    return {"seconds": [seconds], "tok_s": sum(r["max_tokens"] for r in rows) / seconds,
            "batch": STATIC_BATCH}


def run_hf_generate_batch(model_dir: Path, rows: list[dict[str, Any]], args: argparse.Namespace
                          ) -> dict[str, Any]:
    from transformers import GenerationConfig

    model = load_hf(model_dir, args, "sdpa_paged")
    config = GenerationConfig(max_new_tokens=max(r["max_tokens"] for r in rows), do_sample=False,
                              eos_token_id=-1, pad_token_id=2)
    prompts = [r["prompt_token_ids"] for r in rows]
    model.generate_batch(inputs=prompts[:2], generation_config=config)  # warm-up
    sync(args.device)
    t = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=config)
    sync(args.device)
    seconds = time.perf_counter() - t
    generated = sum(len(o.generated_tokens) for o in out.values())
    return {"seconds": [seconds], "tok_s": generated / seconds, "generated": generated}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokenizer", type=Path, required=True,
                   help="a folder with the default model's tokenizer.json / tokenizer_config.json")
    p.add_argument("--shapes", default="smol135m,llama1b")
    p.add_argument("--systems", default=",".join([*OURS, *PEERS]))
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--runs", type=int, default=2, help="timed passes of ours after the first")
    p.add_argument("--peer-requests", type=int, default=None,
                   help="transformers' systems run the workload's first N requests (default: "
                        "all; their tok/s is a rate, and at 256 they alone outrun a 10-minute "
                        "call on an H100)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--budget", type=int, default=8192, help="max_num_batched_tokens")
    p.add_argument("--workload", default=DEFAULT_WORKLOAD)
    p.add_argument("--max-tokens-cap", type=int, default=None, help="quick runs: cap max_tokens")
    p.add_argument("--checkpoints", type=Path, default=Path("/tmp/pdserve-gpu-ckpts"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    bad += [s for s in args.systems.split(",") if s not in (*OURS, *PEERS)]
    if bad or args.requests < 1 or args.runs < 1 or (args.peer_requests or 1) < 1:
        p.error(f"unknown shapes/systems {bad}, or --requests/--runs/--peer-requests below 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    rows = workload(args.workload, args.requests, args.max_tokens_cap)
    device = args.device.split(":")[0]
    results: dict[str, Any] = {"device": torch.cuda.get_device_name()
                               if device == "cuda" else "cpu", "requests": len(rows)}
    runners = {"hf_static": run_hf_static, "hf_generate_batch": run_hf_generate_batch}
    for shape in args.shapes.split(","):
        model_dir = write_checkpoint(shape, args.checkpoints / shape, args.tokenizer, device)
        for system in args.systems.split(","):
            mine = rows if system not in PEERS else rows[:args.peer_requests or len(rows)]
            results[f"{shape}/{system}"] = run_guarded(runners.get(system), system, model_dir,
                                                       mine, args, device)
            print(f"[gpu_engine] {shape} {system}: {results[f'{shape}/{system}']}"[:300],
                  flush=True)
            if args.json:  # after every system: a run cut short keeps what it measured
                args.json.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return results


def run_guarded(run: Any, system: str, model_dir: Path, rows: list[dict], args: Any,
                device: str) -> dict[str, Any]:
    """One system's figures, or its error (the others still run); its memory is handed back
    (gc first: an engine caught in a reference cycle would keep its KV cache)."""
    try:
        return run(model_dir, rows, args) if run else run_ours(system, model_dir, rows, args)
    except Exception as exc:  # noqa: BLE001 - recorded, and the run goes on
        return {"error": f"{type(exc).__name__}: {exc}"[:2000], "tok_s": float("nan")}
    finally:
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def markdown(results: dict[str, Any]) -> str:
    """One row per shape and system: tok/s, its ratio to ours_eager of the same run, the busy
    share, whether ours' first tokens equal ours_eager's, ours' first-pass seconds, and the lowest
    SM clock sampled during ours' passes with any slowdown reason the GPU gave."""
    lines = [f"Device: {results['device']}; {results['requests']} requests.", "",
             "| shape | system | tok/s | / ours_eager | GPU busy | same tokens as eager | "
             "first pass s | SM MHz min (slowdowns) |", "|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        if "/" not in key:
            continue
        shape, system = key.split("/")
        eager = results.get(f"{shape}/ours_eager")
        ratio = f"{r['tok_s'] / eager['tok_s']:.2f}x" if eager else "-"
        busy = r.get("gpu_busy_share", {})
        same = "-" if not eager or "first_tokens" not in r or "first_tokens" not in eager else \
            str(r["first_tokens"] == eager["first_tokens"])
        lines.append(f"| {shape} | {system} | {r['tok_s']:,.0f} | {ratio} | "
                     f"{busy_cell(busy)} | {same} | "
                     f"{r.get('first_run_s', float('nan')):.1f} | {clocks_cell(r)} |")
    return "\n".join(lines)


def busy_cell(busy: dict[str, float]) -> str:
    """The profiled pass's share, then the unprofiled estimate where the run has one (kernel
    time as the profiler saw it, over a pass without it: an estimate, not capped at 100%)."""
    if "busy_share" not in busy:
        return "-"
    unprofiled = busy.get("busy_share_unprofiled")
    return f"{busy['busy_share']:.0%}" + ("" if unprofiled is None else
                                           f" (~{unprofiled:.0%} unprofiled)")


def clocks_cell(result: dict[str, Any]) -> str:
    clocks = result.get("gpu_clocks")
    if not clocks or "sm_mhz_min" not in clocks:
        return "-"
    return f"{clocks['sm_mhz_min']:,.0f} ({', '.join(clocks['slowdown_reasons']) or 'none'})"

if __name__ == "__main__":
    main()

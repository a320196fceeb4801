"""The host's share of an engine step: the model's forward stubbed out, each step run the way a
CUDA engine's host runs it (decode steps through the decode graphs' static buffers, async
scheduling), on CPU.

    python -m benchmarks.host_step [--running 128,256] [--deep 1024] [--steps 100] [--passes 3]
        [--rounds 5] [--kv-cache-gb 4] [--against REV] [--json OUT]

On a GPU, with CUDA graphs, a decode step's forward is one launch; what else the host does in a
step — schedule, build the batch's lists and tensors, launch the sampling, read the tokens back,
advance every request, detokenize, build the outputs — decides whether the GPU waits for it.
At the 1B shape on an H200 the GPU was 68-71% busy with every path on: the host set the pace
(BENCHMARKS.md, "GPU proof"). This measures that host work alone, on any machine:

- decode: ms per decode-only step with `--running` requests running (300-token prompts), and
  with the first count running `--deep` tokens into their outputs; the requests' params are
  those the tree's decode worker runs (delta outputs, no text without stop strings);
- workload: seconds of a pass over `benchmarks.gpu_engine`'s workload (256 requests of
  offline_mixed, 71,208 prompt and 18,688 output tokens, fresh prompts each pass), median and
  mean, and the ms the cyclic collector ran during a pass (mean; its full collections, too);
- gc: ms of a full collection of the child's heap after those, as it is and frozen
  (`gc.freeze()`, as serving processes do: engine.gc_heap).

The stub's logits are one-hot rows over the first 1,024 token ids (a different token per row),
so the sampler, the detokenizer and the stop checks see ordinary tokens. Timings include the
stub's own work (a view of a preallocated tensor, the argmax over 1,024 columns).

`--against REV` checks REV out into a temporary worktree; child processes then take turns, the
earlier tree and this one, each running one round of every case, so that the machine's drift
hits both alike. Reported: each tree's medians (the workload's means too), and this / earlier
(below 1: less host time).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
STUB_VOCAB = 1024
PROMPT_TOKENS = 300


def stubbed_llm(async_scheduling: bool = True, kv_cache_gb: float = 4.0) -> Any:
    """The default model's offline API on CPU, its forward replaced by one-hot logits and its
    decode steps taking the decode graphs' static-buffer path (uncaptured) as on CUDA."""
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.decode_graphs import DecodeGraphs
    from engine.llm import LLM

    llm = LLM(config=EngineConfig(
        model="default", dtype="bfloat16", device="cpu", cache=CacheConfig(kv_cache_gb=kv_cache_gb),
        scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
        async_scheduling=async_scheduling))
    engine = llm.engine
    logits = torch.zeros(8192, STUB_VOCAB, dtype=torch.bfloat16)
    rows = torch.arange(8192)
    logits[rows, 300 + rows * 7 % (STUB_VOCAB - 300)] = 1.0
    runner = engine.runner
    runner._forward = lambda step: logits[: len(step.logits_rows)]
    runner.graphs = DecodeGraphs(lambda ids, positions, md, sample_rows: logits[: len(ids)],
                                 256, engine.max_model_len, runner.block_size,
                                 engine.model_config.num_kv_heads, runner.device, 132,
                                 capture=False)
    return llm


def streaming_params(max_tokens: int) -> Any:
    """Greedy params as the tree's decode worker runs them (serving.worker_params: delta outputs,
    no text without stop strings; 5ed1403's worker asked for delta outputs only, and earlier
    trees' workers for neither)."""
    import dataclasses

    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    # Told apart by the tree's SamplingParams: a module missing from an earlier tree would be
    # imported from this one, second on the child's PYTHONPATH.
    fields = SamplingParams.__dataclass_fields__
    if "detokenize" in fields:
        from serving.worker_params import worker_params

        return worker_params(params)
    if "output_kind" in fields:
        return dataclasses.replace(params, output_kind="delta")
    return params


def decode_ms(engine: Any, running: int, steps: int, first_id: int, depth: int = 0) -> float:
    """Mean ms of `steps` decode-only steps with `running` requests running, `depth` tokens into
    their outputs."""
    params = streaming_params(depth + steps + 16)
    for i in range(running):
        engine.add_request([first_id + i] + list(range(2000, 2000 + PROMPT_TOKENS - 1)), params)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    for _ in range(2 + depth):
        engine.step()
    gc.collect()  # each case starts from the same collector state: a full collection's pause
    start = time.perf_counter()  # then falls where this tree's allocations put it
    for _ in range(steps):
        engine.step()
    elapsed = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    return elapsed / steps * 1e3


def workload_s(llm: Any, run: int) -> float:
    """Seconds of one pass over gpu_engine's workload, the model stubbed out."""
    from benchmarks.common import DEFAULT_WORKLOAD, load_workload
    from engine.request import SamplingParams

    rows = load_workload(DEFAULT_WORKLOAD)
    rows = [rows[i % len(rows)] for i in range(256)]
    # a first token no other pass of this engine used: every pass computes every prompt
    prompts = [[1000 + run % 64 * 256 + i] + r["prompt_token_ids"] for i, r in enumerate(rows)]
    params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True)
              for r in rows]
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start


def one_round(running: list[int], steps: int, passes: int, deep: int,
              kv_cache_gb: float) -> dict[str, Any]:
    """Every case once, in one engine (the child's whole work)."""
    llm = stubbed_llm(kv_cache_gb=kv_cache_gb)
    workload_s(llm, run=passes)  # warm-up: the first steps import and allocate
    result: dict[str, Any] = {"decode_ms": {}, "workload_s": []}
    for k, n in enumerate(running):
        result["decode_ms"][str(n)] = decode_ms(llm.engine, n, steps, 28_000 + 512 * k)
    if deep:
        result["decode_ms"][f"{running[0]}_at_{deep}"] = decode_ms(
            llm.engine, running[0], steps, 28_000 + 512 * len(running), depth=deep)
    result["workload_gc_ms"], result["workload_full_collections"] = [], []
    for p in range(passes):
        with CollectorClock() as clock:
            result["workload_s"].append(workload_s(llm, run=p))
        result["workload_gc_ms"].append(clock.ms)
        result["workload_full_collections"].append(clock.full)
    result["gc_full_ms"] = full_collection_ms()
    gc.freeze()  # as a serving process does once it serves (engine.gc_heap)
    result["gc_full_ms_frozen"] = full_collection_ms()
    gc.unfreeze()
    return result


class CollectorClock:
    """Time the cyclic collector ran, and its full collections, while the block ran (its pauses
    stop the step loop: a median pass may see none, the pass that meets one loses it all)."""

    def __init__(self) -> None:
        self.ms, self.full, self._start = 0.0, 0, 0.0

    def __enter__(self) -> CollectorClock:
        gc.callbacks.append(self._note)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self._note)

    def _note(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        self.ms += (time.perf_counter() - self._start) * 1e3
        self.full += info["generation"] == 2


def full_collection_ms() -> float:
    """Median ms of five full collections of this process's heap (the pause a step loop takes
    when the collector's oldest generation runs)."""
    times = []
    for _ in range(5):
        start = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_child(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One round in a fresh process that imports the engine from `tree`."""
    from benchmarks.common import tree_env  # here: see compare
    from engine.native_kernels import FORWARD_SWITCHES

    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        # The forward is stubbed: the model's native CPU kernels never run, and a worktree
        # would build them afresh (a minute each) for nothing.
        env = tree_env(tree, {**os.environ, **{name: "1" for name in FORWARD_SWITCHES},
                              "PYTHONPATH": f"{tree}{os.pathsep}{REPO}"})
        subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", out.name,
                        "--running", args.running, "--steps", str(args.steps),
                        "--passes", str(args.passes), "--deep", str(args.deep),
                        "--kv-cache-gb", str(args.kv_cache_gb)],
                       cwd=tree, env=env, check=True, timeout=args.timeout)
        return json.loads(Path(out.name).read_text())


def summarize(rounds: list[dict[str, Any]]) -> dict[str, float]:
    """Medians over rounds: each decode case's ms, and the workload pass's seconds."""
    summary = {f"decode_ms_{n}": statistics.median(r["decode_ms"][n] for r in rounds)
               for n in rounds[0]["decode_ms"]}
    summary["workload_s"] = statistics.median(s for r in rounds for s in r["workload_s"])
    for key in ("workload_s", "workload_gc_ms", "workload_full_collections"):
        if key in rounds[0]:  # the mean: where the collector's pauses show
            summary[f"{key}_mean"] = statistics.mean(v for r in rounds for v in r[key])
    for key in ("gc_full_ms", "gc_full_ms_frozen"):
        summary[key] = statistics.median(r[key] for r in rounds)
    return summary


def compare(args: argparse.Namespace) -> dict[str, Any]:
    # here, not at the top: a child imports this file from an earlier tree's PYTHONPATH
    from benchmarks.common import commit_tree, head_commit

    trees: dict[str, Path] = {"this": REPO}
    rounds: dict[str, list[dict[str, Any]]] = {"this": []}
    with commit_tree(args.against) if args.against else contextlib.nullcontext() as earlier:
        if earlier is not None:
            trees, rounds = {"earlier": earlier, **trees}, {"earlier": [], **rounds}
        for i in range(args.rounds):
            for name, tree in trees.items():
                rounds[name].append(run_child(tree, args))
                print(f"round {i + 1} {name}: {summarize(rounds[name][-1:])}", flush=True)
    from benchmarks.cpu_decode_kernel import cpu_description

    model, flags = cpu_description()
    report: dict[str, Any] = {
        "against": args.against, "head": head_commit(), "cpu": model, "cpu_flags": flags,
        "cpus": os.cpu_count(), "rounds": rounds,
        "median": {name: summarize(r) for name, r in rounds.items()}}
    if args.against:
        report["this_over_earlier"] = {key: report["median"]["this"][key] / value
                                       for key, value in report["median"]["earlier"].items()
                                       if value}
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="128,256", help="decode cases: requests running")
    parser.add_argument("--steps", type=int, default=100, help="timed decode steps per case")
    parser.add_argument("--deep", type=int, default=1024,
                        help="one more decode case: the first --running count, this many "
                             "tokens into each output (0: none)")
    parser.add_argument("--passes", type=int, default=3, help="workload passes per round")
    parser.add_argument("--kv-cache-gb", type=float, default=4.0,
                        help="the stubbed engine's KV cache (the default model's KV: ~23 KB a "
                             "token): room for --running requests --deep tokens deep")
    parser.add_argument("--rounds", type=int, default=5, help="child processes per tree")
    parser.add_argument("--against", help="an earlier commit to compare with, side by side")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds per child")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if min(args.steps, args.passes, args.rounds) < 1:
        parser.error("--steps, --passes and --rounds must be >= 1")
    if args.deep < 0:
        parser.error("--deep must be >= 0")
    if args.kv_cache_gb <= 0:
        parser.error("--kv-cache-gb must be > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        running = [int(n) for n in args.running.split(",")]
        args.child.write_text(json.dumps(one_round(running, args.steps, args.passes,
                                                   args.deep, args.kv_cache_gb)))
        return 0
    report = compare(args)
    print(json.dumps({k: report[k] for k in ("median", "this_over_earlier") if k in report},
                     indent=1))
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
        sys.path.pop(0)  # run as a file (a child): import from PYTHONPATH's tree, not here
    raise SystemExit(main())

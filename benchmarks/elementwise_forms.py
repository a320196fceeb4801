"""The decoder layer's element-wise forms side by side on CPU: the torch form, the native kernels
(engine/models/csrc/cpu_elementwise.cpp) and, on request, `torch.compile` of the torch form.
Decode steps of the default model at N running sequences, the forms alternating step by step in
one engine (so drift hits all alike); median step times and their ratios to the torch form.

    python -m benchmarks.elementwise_forms [--running 64] [--steps 40] [--dtype bfloat16]
        [--forms torch,native,compiled]

The first steps of each form (compilation, first-touch) are not timed.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models.cpu_elementwise import NativeCpuElementwise, load_cpu_elementwise
from engine.models.elementwise import TorchElementwise


class CompiledTorchElementwise(TorchElementwise):
    """The torch form's chains through `torch.compile` (dynamic shapes)."""

    name = "compiled"

    def __init__(self) -> None:
        self.add_rms_norm = torch.compile(super().add_rms_norm, dynamic=True)
        self.silu_mul = torch.compile(super().silu_mul, dynamic=True)
        self.rope_qkv = torch.compile(super().rope_qkv, dynamic=True)


def timed_decode_step(engine: LLMEngine) -> float:
    out = engine.scheduler.schedule()
    start = time.perf_counter()
    result = engine.runner.execute(out)
    elapsed = time.perf_counter() - start
    engine.scheduler.update(out, result.sampled, result.logprobs)
    return elapsed


def make_forms(names: list[str]) -> dict[str, TorchElementwise]:
    forms: dict[str, TorchElementwise] = {}
    for name in names:
        if name == "torch":
            forms[name] = TorchElementwise()
        elif name == "native":
            native = load_cpu_elementwise()
            if native is None:
                raise SystemExit("the native element-wise kernels do not build here")
            forms[name] = NativeCpuElementwise(native)
        elif name == "compiled":
            forms[name] = CompiledTorchElementwise()
        else:
            raise SystemExit(f"unknown form {name!r}: torch, native, compiled")
    return forms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="timed steps of each form")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--forms", default="torch,native")
    args = parser.parse_args()
    forms = make_forms(args.forms.split(","))
    engine = LLMEngine(EngineConfig(
        dtype=args.dtype, cache=CacheConfig(kv_cache_gb=2.0),
        scheduler=SchedulerConfig(max_num_seqs=args.running,
                                  max_num_batched_tokens=max(2048, args.running))))
    fill(engine, args.running, max_tokens=(len(forms) + 1) * args.steps + 16)
    model = engine.runner.model
    for form in forms.values():  # warm-up: compilation and first touch
        model.elementwise = form
        for _ in range(2):
            timed_decode_step(engine)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for i in range(len(forms) * args.steps):
        name = list(forms)[i % len(forms)]
        model.elementwise = forms[name]
        times[name].append(timed_decode_step(engine))
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {args.running} sequences decoding, "
          f"{args.dtype}, {args.steps} steps each")
    base = med.get("torch")
    for name, value in med.items():
        ratio = f"  torch / this {base / value:.3f}x" if base else ""
        print(f"  {name:9s} forward + sample median {value * 1e3:8.2f} ms{ratio}")


if __name__ == "__main__":
    main()

"""A decode step's linears through oneDNN and through the panel GEMM
(engine/models/csrc/cpu_small_gemm.cpp), side by side on CPU: decode steps of the default model at
each N running sequences, the two forms alternating step by step in one engine (so drift hits
both alike); median step times and their ratio.

    python -m benchmarks.small_gemm_forms [--running 1,8,16,24,32] [--steps 20]
        [--dtype float32|bfloat16] [--products 64,256,512,2048]
    python -m benchmarks.small_gemm_forms --amx [--running ...] [--steps 20]

--amx (a CPU with AMX): bfloat16 decode steps through oneDNN and through the AMX GEMM
(engine/models/csrc/amx_gemm.cpp) instead, alternating step by step in one engine.

--products times prefill-sized products instead: the default model's four linear shapes on
random weights, at each row count, the forms alternating call by call (GFLOP/s over the four).

The kernel is built here whatever the machine (it needs AVX2 and FMA; bfloat16 AVX512-BF16) and
timed at every N; the "default" column says which form the engine's own policy
(engine.models.cpu_small_gemm) takes there.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from benchmarks.elementwise_forms import timed_decode_step
from benchmarks.step_overhead import fill
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models import cpu_small_gemm as gemm_module
from engine.models import linear as linear_module
from engine.models.amx_gemm import AMX_GEMM_MAX_ROWS, load_amx_gemm
from engine.models.cpu_small_gemm import (
    SmallRowGemm,
    build_small_gemm,
    load_cpu_small_gemm,
    max_rows,
    takes,
)
from engine.models.linear import Linear


def linears(engine: LLMEngine) -> list[Linear]:
    found = [lin for layer in engine.runner.model.layers
             for lin in vars(layer).values() if isinstance(lin, Linear)]
    return [*found, engine.runner.model.lm_head]


def measure(running: int, steps: int, dtype: str = "float32") -> dict[str, float]:
    """Median seconds of a decode step at `running` sequences: oneDNN's and the kernel's."""
    native = build_small_gemm()
    if native is None or not takes(native, getattr(torch, dtype)):
        raise SystemExit(f"the panel GEMM does not build here for {dtype} (it needs AVX2 and "
                         "FMA, and AVX512-BF16 for bfloat16)")
    # This engine packs for both forms: a row limit keeps each layer's oneDNN copy (a layer
    # whose kernel takes every call keeps none), lifted once the engine is built.
    linear_module.load_cpu_small_gemm = lambda: native
    linear_module.amx_row_gemm = lambda weight, bias: None  # the panel kernel's comparison
    unlimited = gemm_module.max_rows
    gemm_module.max_rows = lambda native, dtype: 1
    try:
        engine = LLMEngine(EngineConfig(
            dtype=dtype, cache=CacheConfig(kv_cache_gb=1.0),
            scheduler=SchedulerConfig(max_num_seqs=running,
                                      max_num_batched_tokens=max(512, running))))
    finally:
        gemm_module.max_rows = unlimited
    layers = linears(engine)
    packed = [lin.small_rows for lin in layers]
    for small in packed:
        small.max_rows = None  # timed at every size, whatever the policy
    return alternate_forms(engine, layers, {"onednn": [None] * len(layers), "kernel": packed},
                           running, steps)


def alternate_forms(engine: LLMEngine, layers: list[Linear], forms: dict[str, list],
                    running: int, steps: int) -> dict[str, float]:
    """Median seconds of a decode step at `running` sequences with each form's few-row GEMMs
    in the layers (None: oneDNN), the forms taking turns step by step."""
    fill(engine, running, max_tokens=3 * steps + 16)
    times: dict[str, list[float]] = {name: [] for name in forms}
    for i in range(len(forms) * (steps + 2)):
        name = list(forms)[i % len(forms)]
        for lin, small in zip(layers, forms[name]):
            lin.small_rows = small
        elapsed = timed_decode_step(engine)
        if i >= 2 * len(forms):  # the first steps of each form (first touch) are not timed
            times[name].append(elapsed)
    for request in list(engine.scheduler.all_requests()):
        engine.abort(request.request_id)
    return {name: statistics.median(t) for name, t in times.items()}


def measure_amx(running: int, steps: int) -> dict[str, float]:
    """Median seconds of a bfloat16 decode step at `running` sequences: oneDNN's and the AMX
    GEMM's (engine.models.amx_gemm), alternating step by step in one engine."""
    if load_amx_gemm() is None:
        raise SystemExit("the AMX GEMM does not run here (no AMX, or the tiles were refused)")
    engine = LLMEngine(EngineConfig(
        dtype="bfloat16", cache=CacheConfig(kv_cache_gb=1.0),
        scheduler=SchedulerConfig(max_num_seqs=running, max_num_batched_tokens=max(512, running))))
    layers = linears(engine)
    packed = [lin.small_rows for lin in layers]
    for amx in packed:
        amx.max_rows = amx.native.max_rows()  # timed at every size, whatever the policy
    return alternate_forms(engine, layers, {"onednn": [None] * len(layers), "amx": packed},
                           running, steps)


# SmolLM2-135M's linears (out, in): fused q/k/v, o, fused gate/up, down.
DEFAULT_MODEL_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))


def product_rates(rows: int, dtype: str, calls: int = 30) -> dict[str, float]:
    """GFLOP/s of each form over the default model's four linear shapes at `rows` rows
    (medians of `calls` calls per shape, the first 5 of each form untimed)."""
    native = build_small_gemm()
    if native is None or not takes(native, getattr(torch, dtype)):
        raise SystemExit(f"the panel GEMM does not build here for {dtype}")
    seconds = {"onednn": 0.0, "kernel": 0.0}
    torch.manual_seed(0)
    for out_features, in_features in DEFAULT_MODEL_SHAPES:
        weight = torch.randn(out_features, in_features).to(getattr(torch, dtype))
        x = torch.randn(rows, in_features).to(weight.dtype)
        onednn = Linear(weight, None)
        onednn.small_rows = None
        if onednn.weight is None:  # this machine's policy left no oneDNN copy: make one
            onednn = Linear(weight, None, pack=False)
            onednn.weight = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
            onednn.packed = True
        forms = {"onednn": onednn, "kernel": SmallRowGemm(native, weight, None)}
        times: dict[str, list[float]] = {name: [] for name in forms}
        for _ in range(calls + 5):
            for name, form in forms.items():
                start = time.perf_counter()
                form(x)
                times[name].append(time.perf_counter() - start)
        for name in forms:
            seconds[name] += statistics.median(times[name][5:])
    flops = 2 * rows * sum(n * k for n, k in DEFAULT_MODEL_SHAPES)
    return {name: flops / t / 1e9 for name, t in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--running", default="1,8,16,24,32")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each form")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--products", help="row counts: time prefill-sized products instead")
    parser.add_argument("--amx", action="store_true",
                        help="bfloat16 decode steps: oneDNN against the AMX GEMM instead")
    args = parser.parse_args()
    if args.products:
        print_products(args.products, args.dtype)
    elif args.amx:
        print_steps(args.running, args.steps, "bfloat16", amx=True)
    else:
        print_steps(args.running, args.steps, args.dtype, amx=False)


def print_products(products: str, dtype: str) -> None:
    print(f"{dtype} products of the default model's linear shapes, GFLOP/s")
    print("| rows | oneDNN | panel GEMM | kernel / oneDNN |")
    print("|---|---|---|---|")
    for rows in (int(n) for n in products.split(",")):
        rate = product_rates(rows, dtype)
        print(f"| {rows} | {rate['onednn']:.0f} | {rate['kernel']:.0f} | "
              f"{rate['kernel'] / rate['onednn']:.2f}x |", flush=True)


def print_steps(running_list: str, steps: int, dtype: str, amx: bool) -> None:
    """Decode steps at each running count: oneDNN against the panel GEMM, or (`amx`) against
    the AMX GEMM."""
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, torch {torch.__version__}; {dtype} decode steps, {steps} each")
    other = "AMX GEMM" if amx else "panel GEMM"
    print(f"| running | oneDNN ms | {other} ms | oneDNN / {other} |"
          + ("" if amx else " default |"))
    print("|---|---|---|---|" + ("" if amx else "---|"))
    for running in (int(n) for n in running_list.split(",")):
        med = measure_amx(running, steps) if amx else measure(running, steps, dtype)
        key = "amx" if amx else "kernel"
        line = (f"| {running} | {med['onednn'] * 1e3:.1f} | {med[key] * 1e3:.1f} | "
                f"{med['onednn'] / med[key]:.2f}x |")
        print(line + ("" if amx else f" {default_form(running, dtype)} |"), flush=True)


def default_form(running: int, dtype: str) -> str:
    if dtype == "bfloat16" and load_amx_gemm() is not None and running <= AMX_GEMM_MAX_ROWS:
        return "AMX GEMM"
    native = build_small_gemm()
    if native is None or load_cpu_small_gemm() is None:
        return "oneDNN"
    limit = max_rows(native, getattr(torch, dtype))
    return "kernel" if limit is None or running <= limit else "oneDNN"


if __name__ == "__main__":
    main()

"""One mixture-of-experts MLP layer on CPU (engine.models.moe): the grouped path (the (token,
expert) pairs sorted by expert once: one gather, a pair of matmuls per expert on its contiguous
slice, the rows added back per token) against the per-expert loop (each expert's tokens found by
`torch.where`, an index-add per expert), at batch sizes from one decode token to a prefill chunk;
on CUDA (`--device cuda`) the grouped-GEMM Triton kernel (engine.models.fused_moe) beside them.

    python -m benchmarks.moe_layer [--threads 2] [--repeats 30] [--device cpu|cuda] [--json OUT]

Shapes: Mixtral's routing (8 experts, 2 per token) and Qwen3-MoE's (128 experts, 8 per token) at
reduced widths a 2-core machine times in seconds (hidden 1024; intermediate 1792 for Mixtral's
shape and 384 for Qwen3-MoE's narrow experts), random weights and tokens (routing spread over
the experts as a random router spreads it). Each figure is the median of `--repeats` timed calls
after warm-up, the paths alternating call by call; the grouped path's output is checked equal
to the loop's (on CUDA within float32 noise, as is the Triton kernel's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmarks.cpu_decode_kernel import cpu_description
from engine.config import MoEConfig
from engine.models.moe import MoEMLP

# name: (experts, per token, hidden, intermediate)
SHAPES = {"mixtral-8x2": (8, 2, 1024, 1792), "qwen3moe-128x8": (128, 8, 1024, 384)}
TOKENS = (1, 8, 64, 256)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_layer(shape: tuple[int, int, int, int], dtype: torch.dtype,
               device: str = "cpu") -> MoEMLP:
    experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(0)

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * dims[-1] ** -0.5).to(dtype).to(device)

    return MoEMLP(MoEConfig(experts, top_k, inter, True), weight(experts, hidden),
                  weight(experts, 2 * inter, hidden), weight(experts, hidden, inter))


def paths_of(layer: MoEMLP, device: str) -> dict[str, Callable[..., torch.Tensor]]:
    paths = {"loop": layer.per_expert_loop, "grouped": layer.grouped}
    if device == "cuda":
        from engine.models.fused_moe import fused_moe

        paths["triton"] = lambda x, w, e: fused_moe(x, layer.gate_up, layer.down, w, e)
    return paths


def check_outputs(paths: dict[str, Callable[..., torch.Tensor]], x: torch.Tensor,
                  weights: torch.Tensor, experts: torch.Tensor) -> None:
    loop = paths["loop"](x, weights, experts)
    for name, path in paths.items():
        got = path(x, weights, experts)
        same = torch.equal(got, loop) if x.device.type == "cpu" and name == "grouped" else \
            torch.allclose(got.float(), loop.float(), atol=5e-2, rtol=2e-2)
        if not same:
            raise AssertionError(f"the {name} path's output differs from the loop's")


def time_paths(layer: MoEMLP, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each path, alternating (routing excluded: the same for all)."""
    weights, experts = layer.route(x)
    paths = paths_of(layer, x.device.type)
    check_outputs(paths, x, weights, experts)
    sync = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats + 3):
        for name, path in paths.items():
            sync()
            start = time.perf_counter()
            path(x, weights, experts)
            sync()
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run(repeats: int, device: str) -> list[dict]:
    rows = []
    for shape_name, shape in SHAPES.items():
        for dtype_name, dtype in DTYPES.items():
            layer = make_layer(shape, dtype, device)
            for tokens in TOKENS:
                x = torch.randn(tokens, shape[2], generator=torch.Generator().manual_seed(
                    tokens)).to(dtype).to(device)
                medians = time_paths(layer, x, repeats)
                rows.append({"shape": shape_name, "dtype": dtype_name, "tokens": tokens,
                             **{f"{name}_ms": t * 1e3 for name, t in medians.items()},
                             "speedup": medians["loop"] / medians["grouped"]})
                print(f"{shape_name:15} {dtype_name} {tokens:4} tokens: " + "  ".join(
                    f"{name} {t * 1e3:8.3f} ms" for name, t in medians.items())
                    + f"  grouped {rows[-1]['speedup']:.2f}x the loop", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, flags = cpu_description()
    gpu = torch.cuda.get_device_name() if args.device == "cuda" else None
    print(f"{gpu or model}; {flags}; {args.threads} threads; torch {torch.__version__}")
    rows = run(args.repeats, args.device)
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": model, "flags": flags, "threads": args.threads,
                                         "gpu": gpu, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

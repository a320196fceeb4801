"""One mixture-of-experts MLP layer on CPU (engine.models.moe): the grouped path (the (token,
expert) pairs sorted by expert once: one gather, a pair of matmuls per expert on its contiguous
slice, the rows added back per token) against the per-expert loop (each expert's tokens found by
`torch.where`, an index-add per expert), at batch sizes from one decode token to a prefill chunk.

    python -m benchmarks.moe_layer [--threads 2] [--repeats 30] [--json OUT]

Shapes: Mixtral's routing (8 experts, 2 per token) and Qwen3-MoE's (128 experts, 8 per token) at
reduced widths a 2-core machine times in seconds (hidden 1024; intermediate 1792 for Mixtral's
shape and 384 for Qwen3-MoE's narrow experts), random weights and tokens (routing spread over
the experts as a random router spreads it). Each figure is the median of `--repeats` timed calls
after warm-up, the two paths alternating call by call; both paths' outputs are checked equal.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from benchmarks.cpu_decode_kernel import cpu_description
from engine.config import MoEConfig
from engine.models.moe import MoEMLP

# name: (experts, per token, hidden, intermediate)
SHAPES = {"mixtral-8x2": (8, 2, 1024, 1792), "qwen3moe-128x8": (128, 8, 1024, 384)}
TOKENS = (1, 8, 64, 256)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_layer(shape: tuple[int, int, int, int], dtype: torch.dtype) -> MoEMLP:
    experts, top_k, hidden, inter = shape
    g = torch.Generator().manual_seed(0)

    def weight(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=g) * dims[-1] ** -0.5).to(dtype)

    return MoEMLP(MoEConfig(experts, top_k, inter, True), weight(experts, hidden),
                  weight(experts, 2 * inter, hidden), weight(experts, hidden, inter))


def time_paths(layer: MoEMLP, x: torch.Tensor, repeats: int) -> dict[str, float]:
    """Median seconds per call of each path, alternating (routing excluded: the same for both)."""
    weights, experts = layer.route(x)
    paths = {"loop": layer.per_expert_loop, "grouped": layer.grouped}
    if not torch.equal(paths["loop"](x, weights, experts), paths["grouped"](x, weights, experts)):
        raise AssertionError("the grouped path's output differs from the loop's")
    times: dict[str, list[float]] = {name: [] for name in paths}
    for i in range(repeats + 3):
        for name, path in paths.items():
            start = time.perf_counter()
            path(x, weights, experts)
            if i >= 3:  # warm-up
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def run(repeats: int) -> list[dict]:
    rows = []
    for shape_name, shape in SHAPES.items():
        for dtype_name, dtype in DTYPES.items():
            layer = make_layer(shape, dtype)
            for tokens in TOKENS:
                x = torch.randn(tokens, shape[2], generator=torch.Generator().manual_seed(
                    tokens)).to(dtype)
                medians = time_paths(layer, x, repeats)
                rows.append({"shape": shape_name, "dtype": dtype_name, "tokens": tokens,
                             "loop_ms": medians["loop"] * 1e3,
                             "grouped_ms": medians["grouped"] * 1e3,
                             "speedup": medians["loop"] / medians["grouped"]})
                print(f"{shape_name:15} {dtype_name} {tokens:4} tokens: loop "
                      f"{rows[-1]['loop_ms']:8.2f} ms  grouped {rows[-1]['grouped_ms']:8.2f} ms"
                      f"  {rows[-1]['speedup']:.2f}x", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, flags = cpu_description()
    print(f"{model}; {flags}; {args.threads} threads; torch {torch.__version__}")
    rows = run(args.repeats)
    if args.json is not None:
        args.json.write_text(json.dumps({"cpu": model, "flags": flags, "threads": args.threads,
                                         "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""oneDNN's packed bfloat16 GEMM at every row count of a decode step, the default model's shapes
called in turn as a forward pass calls them (so each finds the others' weights in the caches),
each row count as given and as `engine.models.linear.onednn_rows` pads it. Where the CPU has
AMX that padding takes 17-32 rows to 33 (BENCHMARKS.md, "On the AMX Xeon again").

    python -m benchmarks.onednn_rows [--rows 9-80] [--repeats 15] [--json OUT]

Prints, per row count, ms for one layer's four linears and for the lm_head: exact, padded (where
the rule pads) and their ratio. Medians of --repeats passes, the row counts taking turns.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from engine.models.linear import onednn_rows

# the default model's (SmolLM2-135M) fused projections and its tied lm_head: (out, in)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
          "lm_head": (49152, 576)}
LAYER = ("qkv", "o", "gate_up", "down")


def parse_rows(text: str) -> list[int]:
    low, _, high = text.partition("-")
    return list(range(int(low), int(high or low) + 1))


def time_calls(weights: dict[str, torch.Tensor], counts: list[int], repeats: int
               ) -> dict[int, dict[str, float]]:
    """Median ms per (row count, shape), the shapes and row counts taking turns."""
    inputs = {(m, n): torch.randn(m, w.shape[1]).bfloat16()
              for m in counts for n, w in weights.items()}
    samples: dict[int, dict[str, list[float]]] = {m: {n: [] for n in weights} for m in counts}
    for rep in range(repeats + 2):  # two passes create each row count's primitives first
        for m in counts:
            for n, w in weights.items():
                start = time.perf_counter()
                torch.ops.mkldnn._linear_pointwise(inputs[(m, n)], w, None, "none", [], "")
                if rep >= 2:
                    samples[m][n].append((time.perf_counter() - start) * 1e3)
    return {m: {n: statistics.median(v) for n, v in d.items()} for m, d in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="9-80")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    weights = {n: torch.ops.mkldnn._reorder_linear_weight(
        (torch.randn(*s) * 0.02).bfloat16(), 64) for n, s in SHAPES.items()}
    rows = parse_rows(args.rows)
    padded = {m: onednn_rows(m, amx_bf16=True) for m in rows}
    ms = time_calls(weights, sorted(set(rows) | set(padded.values())), args.repeats)
    print(f"machine: {platform.machine()}, {torch.get_num_threads()} threads, torch "
          f"{torch.__version__}; ms, medians of {args.repeats}\n")
    print("| rows | layer's 4 linears | padded to | padded / exact | lm_head | padded / exact |")
    print("|---|---|---|---|---|---|")
    for m in rows:
        layer = sum(ms[m][n] for n in LAYER)
        head, q = ms[m]["lm_head"], padded[m]
        cells = (f"{q} | {sum(ms[q][n] for n in LAYER) / layer:.2f} | {head:.3f} | "
                 f"{ms[q]['lm_head'] / head:.2f}" if q != m else f"- | - | {head:.3f} | -")
        print(f"| {m} | {layer:.3f} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "ms": ms}, indent=1) + "\n")


if __name__ == "__main__":
    main()

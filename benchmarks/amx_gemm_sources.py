"""The AMX GEMM (engine/models/csrc/amx_gemm.cpp) built from this tree and from another source,
beside oneDNN, on the default model's linears with the weights not in cache: ms for one step's
worth of calls (the four linear shapes of 30 layers, lm_head left out) at each row count, the
forms taking turns, medians of the repetitions.

    python -m benchmarks.amx_gemm_sources [--baseline OLD.cpp] [--rows 16,32,64,96] [--reps 9]

`--baseline` takes, say, an earlier commit's kernel (`git show REV:engine/models/csrc/amx_gemm.cpp
> /tmp/old.cpp`). Each layer has its own weights (30 x 105 M parameters, 210 MB in bfloat16), so
a pass streams them from memory as a decode step does. Needs a CPU with AMX.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from benchmarks.small_gemm_forms import DEFAULT_MODEL_SHAPES
from engine.models.amx_gemm import CFLAGS, PREFIX, SOURCE
from engine.models.linear import _PACK_BATCH_HINT
from engine.native_build import build_native

LAYERS = 30


def forms(baseline: Path | None) -> dict[str, Callable[[list[torch.Tensor]], None]]:
    """Each form's pass over every layer's four linears for the given inputs."""
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).to(torch.bfloat16) for n, k in DEFAULT_MODEL_SHAPES]
               for _ in range(LAYERS)]
    modules = {"tree": build_native(PREFIX, SOURCE, CFLAGS)}
    if baseline is not None:
        modules["baseline"] = build_native(PREFIX + "_baseline", baseline, CFLAGS)
    result: dict[str, Callable[[list[torch.Tensor]], None]] = {}
    packs = packed_weights(modules, weights)
    for name, module in modules.items():
        result[name] = amx_pass(module, packs[name])
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, _PACK_BATCH_HINT) for w in layer]
              for layer in weights]

    def onednn_pass(xs: list[torch.Tensor]) -> None:
        for layer in onednn:
            for x, w in zip(xs, layer):
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")

    result["oneDNN"] = onednn_pass
    return result


def packed_weights(modules: dict[str, ModuleType], weights: list[list[torch.Tensor]]
                   ) -> dict[str, list[list[torch.Tensor]]]:
    """Each build's packed weights: one set for every build that packs as the tree does. Two
    copies of the same 210 MB placed apart read differently: with a build of the tree's own
    source as the baseline, each packing its own copy, the tree read 1.07-1.25x slower than its
    twin at 32 and 64 rows in two invocations on a Xeon reporting family 6 model 167; with one
    copy shared, 1.00-1.04x."""
    packs: dict[str, list[list[torch.Tensor]]] = {}
    for name, module in modules.items():
        if not module.available():
            raise SystemExit("the AMX GEMM does not run here (no AMX, or the tiles were refused)")
        first = [module.pack(w) for w in weights[0]]
        if "tree" in packs and all(torch.equal(a, b) for a, b in zip(first, packs["tree"][0])):
            packs[name] = packs["tree"]
            continue
        if "tree" in packs:
            print(f"{name} packs the weights differently: it streams its own copy, whose "
                  "placement alone can move its times by up to 25%")
        packs[name] = [first] + [[module.pack(w) for w in layer] for layer in weights[1:]]
    return packs


def amx_pass(module: ModuleType, packed: list[list[torch.Tensor]]
             ) -> Callable[[list[torch.Tensor]], None]:
    def run(xs: list[torch.Tensor]) -> None:
        for layer in packed:
            for x, w, (n, k) in zip(xs, layer, DEFAULT_MODEL_SHAPES):
                module.linear(x, w, n, k, None)

    return run


def medians(passes: dict[str, Callable[[list[torch.Tensor]], None]], rows: int,
            reps: int) -> dict[str, float]:
    """Median ms of each form's pass. The forms take turns, their order rotating every round:
    on a Xeon reporting family 6 model 167, with a fixed order, the same source read 15-18%
    slower at one row placed first than placed last, more than the forms compared differed
    (each form streams its own 210 MB of weights; what sits in L3 depends on what ran before)."""
    xs = [torch.randn(rows, k).to(torch.bfloat16) for _, k in DEFAULT_MODEL_SHAPES]
    names = list(passes)
    times: dict[str, list[float]] = {name: [] for name in passes}
    for rep in range(reps + 1):  # the first round warms up
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            start = time.perf_counter()
            passes[name](xs)
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", type=Path, default=None)
    parser.add_argument("--rows", default="16,32,64,96")
    parser.add_argument("--reps", type=int, default=9)
    args = parser.parse_args()
    passes = forms(args.baseline)
    print(f"{torch.get_num_threads()} threads; ms per pass over {LAYERS} layers' linears, "
          f"medians of {args.reps}")
    print("| rows | " + " | ".join(passes) + " |")
    print("|---" * (len(passes) + 1) + "|")
    for rows in (int(r) for r in args.rows.split(",")):
        ms = medians(passes, rows, args.reps)
        print(f"| {rows} | " + " | ".join(f"{ms[name]:.1f}" for name in passes) + " |",
              flush=True)


if __name__ == "__main__":
    main()

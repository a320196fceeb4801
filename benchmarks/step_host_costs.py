"""A CPU step's smaller costs, with and without the forms that removed them, taking turns step by
step in one engine (so both see the same host, batch and contexts).

    python -m benchmarks.step_host_costs [--running 64,32,8] [--prompt 256,512]
        [--dtypes bfloat16,float32] [--pairs 40] [--json OUT]

"before" puts back, at run time, what each of these replaced (2026-11-28): K/V stored by two
`index_copy_` calls (`write_kv_cache`), not the native row copies; a layer's closing residual
add as its own torch op, not folded into the next layer's norm; logits widened to float32 before
the sampler, and the torch blocked argmax, not the native one on bf16 logits; q, k, v split in
Python around the RoPE call, not returned by it; bfloat16 rounded in the element-wise kernels by
integer operations, not vcvtneps2bf16 (the build of that module's source at `--elementwise-rev`).
A decode-only step's prefill-kernel checks are not put back. Per case: the median step of each
form, the median of the pairs' ratios (before / after) and how many pairs the new form won.
Decode cases fill `--running` sequences with the offline workload's prompts; prompt cases time a
lone fresh prompt's step (one token out).
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import engine.row_argmax as row_argmax_module
from benchmarks.common import file_at, write_json
from benchmarks.step_overhead import fill
from engine.attention.interface import write_kv_cache
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models import cpu_elementwise
from engine.models.elementwise import TorchElementwise
from engine.models.llama import LlamaModel
from engine.native_build import build_native
from engine.request import SamplingParams

ELEMENTWISE_SOURCE = "engine/models/csrc/cpu_elementwise.cpp"


def old_elementwise(rev: str, folder: Path) -> ModuleType:
    source = folder / "cpu_elementwise_before.cpp"
    source.write_bytes(file_at(rev, ELEMENTWISE_SOURCE))
    return build_native("pdserve_elementwise_before", source, cpu_elementwise.CFLAGS)


class Forms:
    """Switches one engine between the forms before and after."""

    def __init__(self, engine: LLMEngine, before_elementwise: ModuleType):
        self.engine = engine
        self.modules = {True: engine.runner.model.elementwise.native, False: before_elementwise}
        self.write_kv = engine.runner.attention.write_kv
        self.load_argmax = row_argmax_module.load_native_argmax
        self.forward = LlamaModel.forward
        self.rope_qkv = cpu_elementwise.NativeCpuElementwise.rope_qkv

    def use(self, after: bool) -> None:
        runner, native_class = self.engine.runner, cpu_elementwise.NativeCpuElementwise
        runner.model.elementwise.native = self.modules[after]
        native_class.defers_residual = after
        native_class.rope_qkv = self.rope_qkv if after else TorchElementwise.rope_qkv
        runner.attention.write_kv = self.write_kv if after else write_kv_cache
        row_argmax_module.load_native_argmax = self.load_argmax if after else lambda: None
        LlamaModel.forward = self.forward if after else _float_logits(self.forward)


def _float_logits(forward: Callable[..., Any]) -> Callable[..., Any]:
    def widened(self: LlamaModel, *args: Any, float_logits: bool = True, **kwargs: Any) -> Any:
        return forward(self, *args, float_logits=True, **kwargs)
    return widened


def timed(step: Callable[[], Any]) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def pairs_of(forms: Forms, pairs: int, one: Callable[[bool, int], float]) -> dict[str, float]:
    before, after, ratios = [], [], []
    for i in range(pairs):
        times = {}
        for form in ((True, False) if i % 2 else (False, True)):
            forms.use(form)
            times[form] = one(form, i)
        before.append(times[False])
        after.append(times[True])
        ratios.append(times[False] / times[True])
    forms.use(True)
    return {"before_ms": statistics.median(before) * 1e3,
            "after_ms": statistics.median(after) * 1e3,
            "ratio": statistics.median(ratios), "after_won": sum(r > 1 for r in ratios),
            "pairs": pairs}


def engine_for(dtype: str, running: int) -> LLMEngine:
    return LLMEngine(EngineConfig(dtype=dtype, cache=CacheConfig(kv_cache_gb=2.0),
                                  scheduler=SchedulerConfig(max_num_seqs=max(running, 1),
                                                            max_num_batched_tokens=2048)))


def decode_case(dtype: str, running: int, pairs: int, before: ModuleType) -> dict[str, float]:
    engine = engine_for(dtype, running)
    forms = Forms(engine, before)
    fill(engine, running, max_tokens=2 * pairs + 10)
    for form in (True, False, True):  # warm both forms
        forms.use(form)
        engine.step()
    return pairs_of(forms, pairs, lambda form, i: timed(engine.step))


def prompt_case(dtype: str, length: int, pairs: int, before: ModuleType) -> dict[str, float]:
    engine = engine_for(dtype, 1)
    forms = Forms(engine, before)

    def one(form: bool, i: int) -> float:
        # a fresh first token per prompt: nothing comes from the prefix cache
        engine.add_request([9000 + 2 * i + int(form)] + [5] * (length - 1),
                           SamplingParams(temperature=0, max_tokens=1))
        spent = timed(engine.step)
        while engine.has_unfinished_requests():
            engine.step()
        return spent

    pairs_of(forms, 2, one)  # warm both forms
    return pairs_of(forms, pairs, one)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", default="64,32,8")
    parser.add_argument("--prompt", default="256,512")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--pairs", type=int, default=40)
    parser.add_argument("--elementwise-rev", default="af74992",
                        help="the commit whose element-wise source is the 'before' build")
    parser.add_argument("--json")
    args = parser.parse_args()
    print(f"machine: {platform.machine()}, {platform.processor() or 'cpu'}")
    results: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as folder:
        before = old_elementwise(args.elementwise_rev, Path(folder))
        for dtype in args.dtypes.split(","):
            cases = [(f"{dtype}, decode, {n} running", decode_case, n)
                     for n in map(int, filter(None, args.running.split(",")))]
            cases += [(f"{dtype}, one {n}-token prompt", prompt_case, n)
                      for n in map(int, filter(None, args.prompt.split(",")))]
            for name, case, size in cases:
                results[name] = r = case(dtype, size, args.pairs, before)
                print(f"| {name} | {r['before_ms']:.1f} | {r['after_ms']:.1f} | "
                      f"{r['ratio']:.3f}x | {r['after_won']}/{r['pairs']} |", flush=True)
    if args.json:
        write_json(args.json, {"results": results, "args": vars(args)})


if __name__ == "__main__":
    main()

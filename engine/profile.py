"""Measure one worker's speed for the P:D planner (`python -m router plan`): how long prompts take
to prefill and how long a decode step takes at each batch size, with the offline engine on this
machine, fitted to the cost model the planner simulates (planner.simulator.Profile).

    .venv/bin/python -m engine.profile [--model default] [--dtype float32] [--threads 1]
        [--tensor-parallel-size 1] [--out profile.json]

Prefill: each length's prompt alone (random token ids, 512-token chunks as the workers run
them), median of `--repeats`; fitted as steps × per-step + tokens × per-token + tokens² ×
per-token² (attention grows with the context). Decode: `b` requests of 128-token prompts
decoding together, the median step; fitted as base + b × per-sequence. Run it on the machine
(and with the threads) the workers will have.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from engine.config import EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams

CHUNK_TOKENS = 512  # the workers' step budget (SchedulerConfig.max_num_batched_tokens)


def _engine(model: str, dtype: str | None, tensor_parallel_size: int = 1) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model, dtype=dtype, scheduler=SchedulerConfig(
        max_num_batched_tokens=CHUNK_TOKENS, max_num_seqs=64),
        tensor_parallel_size=tensor_parallel_size))


def _prompt(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(100, vocab) for _ in range(n)]


def prefill_seconds(engine: LLMEngine, n: int, repeats: int, rng: random.Random) -> float:
    """Median seconds to prefill an `n`-token prompt alone (fresh tokens: no prefix-cache hit)."""
    times = []
    for _ in range(repeats):
        engine.add_request(_prompt(rng, n, engine.model_config.vocab_size),
                           SamplingParams(max_tokens=1))
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def decode_step_seconds(engine: LLMEngine, batch: int, steps: int, rng: random.Random) -> float:
    """Median decode-step seconds with `batch` requests of 128-token prompts running."""
    for _ in range(batch):
        engine.add_request(_prompt(rng, 128, engine.model_config.vocab_size),
                           SamplingParams(max_tokens=steps + 4, ignore_eos=True))
    while engine.scheduler.num_waiting or any(
            r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.all_requests()):
        engine.step()  # every prompt prefilled: the steps timed below decode only
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(times)


def least_squares(rows: list[list[float]], values: list[float]) -> list[float]:
    solution = torch.linalg.lstsq(torch.tensor(rows, dtype=torch.float64),
                                  torch.tensor(values, dtype=torch.float64).unsqueeze(1))
    return [max(0.0, float(x)) for x in solution.solution.squeeze(1)]


def measure(model: str, dtype: str | None, lengths: list[int], batches: list[int],
            repeats: int, tensor_parallel_size: int = 1) -> dict:
    engine = _engine(model, dtype, tensor_parallel_size)
    rng = random.Random(0)
    prefill_seconds(engine, 64, 1, rng)  # warm-up
    prefill = [prefill_seconds(engine, n, repeats, rng) for n in lengths]
    decode = [decode_step_seconds(engine, b, 8, rng) for b in batches]
    step, token, token2 = least_squares(
        [[-(-n // CHUNK_TOKENS), n, n * n] for n in lengths], prefill)
    base, per_seq = least_squares([[1.0, b] for b in batches], decode)
    engine.close()
    return {"model": model, "dtype": str(engine.dtype).removeprefix("torch."),
            "threads": torch.get_num_threads(), "tensor_parallel_size": tensor_parallel_size,
            "chunk_tokens": CHUNK_TOKENS,
            "prefill": {"lengths": lengths, "seconds": prefill,
                        "per_step_s": step, "per_token_s": token, "per_token2_s": token2},
            "decode": {"batches": batches, "step_seconds": decode,
                       "base_s": base, "per_seq_s": per_seq}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1,
                        help="the worker's torch threads (as its --threads: under tensor "
                             "parallelism rank 0 keeps them and ranks 1.. get a share)")
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--lengths", default="128,512,1024,2048")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    profile = measure(args.model, args.dtype, [int(x) for x in args.lengths.split(",")],
                      [int(x) for x in args.batches.split(",")], args.repeats,
                      args.tensor_parallel_size)
    text = json.dumps(profile, indent=2)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()

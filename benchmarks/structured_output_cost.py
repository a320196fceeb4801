"""What structured output costs (issue 30): offline tok/s of a batch in which half the requests
carry a JSON schema, against the same batch with none, in one engine, alternating.

    python -m benchmarks.structured_output_cost [--requests 32] [--max-tokens 64] [--runs 3]
        [--dtype bfloat16]

tok/s = output tokens / wall time of the batch. Constrained requests end when their JSON is
complete (they are shorter); unconstrained ones ignore EOS and run to max_tokens. The ratio of
the medians is the target's (>= 0.8x on CPU).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import torch

from engine.config import EngineConfig
from engine.llm import LLM
from engine.request import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "city": {"type": "string", "maxLength": 24},
                         "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16},
                                     "maxItems": 3}}}
PEOPLE = ["Ann", "Bob", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]


def batch(llm: LLM, n: int, max_tokens: int, constrained: bool
          ) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = [], []
    for i in range(n):
        who = PEOPLE[i % len(PEOPLE)]
        prompts.append(llm.tokenizer.encode_chat([{"role": "user", "content":
            f"Describe a person named {who} (request {i}) as JSON with name, age, city "
            f"and hobbies."}]))
        json_row = constrained and i % 2 == 0
        params.append(SamplingParams(
            temperature=0, max_tokens=max_tokens, ignore_eos=not json_row,
            structured_output=StructuredOutput("json_schema", json.dumps(SCHEMA))
            if json_row else None))
    return prompts, params


def timed(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    llm.engine.block_manager.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    for out, p in zip(outs, params):
        if p.structured_output is not None:
            json.loads(out.text)  # each constrained output is complete JSON
    return tokens / seconds, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dtype", default=None)
    args = parser.parse_args()
    llm = LLM(config=EngineConfig(model="default", dtype=args.dtype))
    cases = {c: batch(llm, args.requests, args.max_tokens, c) for c in (False, True)}
    timed(llm, *cases[True])  # warm-up: oneDNN primitives, the grammar compiled once
    rates: dict[bool, list[float]] = {False: [], True: []}
    tokens: dict[bool, int] = {}
    for _ in range(args.runs):
        for constrained in (False, True):
            rate, tokens[constrained] = timed(llm, *cases[constrained])
            rates[constrained].append(rate)
    plain, mixed = (statistics.median(rates[c]) for c in (False, True))
    print(f"machine: {platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads, dtype {llm.engine.dtype}; {args.requests} requests, max_tokens "
          f"{args.max_tokens}, medians of {args.runs}")
    print("| batch | output tokens | tok/s (all runs) | median |")
    print("|---|---|---|---|")
    for constrained, median in ((False, plain), (True, mixed)):
        name = "half with a JSON schema" if constrained else "no constraint"
        runs = ", ".join(f"{r:.1f}" for r in rates[constrained])
        print(f"| {name} | {tokens[constrained]} | {runs} | {median:.1f} |")
    print(f"ratio (half constrained / none): {mixed / plain:.2f}x")


if __name__ == "__main__":
    main()

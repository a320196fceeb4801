"""Where a served token's time goes: the same streams through the engine alone, the colocated
cluster over gRPC, and the colocated cluster over HTTP/SSE, measured side by side in one run.

    .venv/bin/python -m benchmarks.served_token_path [--concurrency 1,4] [--prompt-tokens 256]
        [--max-tokens 128] [--dtype bfloat16] [--threads 2] [--runs 3] [--json OUT]

Every request is greedy with EOS ignored and starts with its own first token (no prefix-cache
hit). Per request the client records when each token arrives; the inter-token latency (ITL) of a
request is the median of its gaps, and each row reports the median over requests and runs. The
engine runs in this process (`LLM.stream`, `--threads` torch threads); the cluster is
`router launch --colocated 1 --threads N` (its worker and router share this machine's cores
with the client, as they would in use). The difference between rows is what each hop adds.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from benchmarks.kv_transfer import cpu_model
from loadtest.workloads import OFFLINE_MIXED


def prompts(count: int, length: int, first: int) -> list[list[int]]:
    """`count` prompts of `length` tokens of real text, each with a first token of its own."""
    rows = [json.loads(line)["prompt_token_ids"] for line in OFFLINE_MIXED.open()]
    text = [t for row in rows for t in row[1:]]
    return [[first + i] + text[i * 97:i * 97 + length - 1] for i in range(count)]


def itl(times: list[float]) -> float:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return statistics.median(gaps) if gaps else float("nan")


def engine_itls(llm: Any, batch: list[list[int]], max_tokens: int) -> list[float]:
    from engine.request import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    arrivals: dict[str, list[float]] = {}
    for outputs in llm.stream(batch, params):
        now = time.perf_counter()
        for out in outputs:
            if out.new_token_ids:
                arrivals.setdefault(out.request_id, []).append(now)
    return [itl(times) for times in arrivals.values()]


def grpc_times(address: str, ids: list[int], max_tokens: int) -> list[float]:
    from common.grpc_server import channel
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc

    times: list[float] = []
    with channel(address) as ch:
        request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids),
                                     sampling=pb.SamplingOptions(max_tokens=max_tokens,
                                                                 temperature=0, ignore_eos=True))
        for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=600):
            if part.token_ids:
                times.append(time.perf_counter())
    return times


def http_times(address: str, model: str, ids: list[int], max_tokens: int) -> list[float]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    reply = conn.getresponse()
    times: list[float] = []
    while line := reply.readline():
        if line.startswith(b"data: {") and json.loads(line[6:])["choices"]:
            times.append(time.perf_counter())
    conn.close()
    return times


def concurrent_itls(fetch: Any, batch: list[list[int]]) -> list[float]:
    with ThreadPoolExecutor(len(batch)) as pool:
        return [itl(times) for times in pool.map(fetch, batch)]


def measure(args: argparse.Namespace) -> dict[str, dict[int, list[float]]]:
    """ITLs per path and concurrency, over every run; each run uses fresh prompts."""
    import torch

    from engine.llm import LLM
    from launch.cluster import ClusterSpec, LocalCluster

    results: dict[str, dict[int, list[float]]] = {p: {} for p in ("engine", "grpc", "http")}
    torch.set_num_threads(args.threads)
    llm = LLM(dtype=args.dtype)
    spec = ClusterSpec(prefill=0, decode=0, colocated=1, port=0, threads=args.threads,
                       dtype=args.dtype)
    first = 1000
    with LocalCluster(spec, Path(tempfile.mkdtemp(prefix="served-")) / "logs") as cluster:
        status = cluster.status()
        fetch = {"engine": lambda batch: engine_itls(llm, batch, args.max_tokens),
                 "grpc": lambda batch: concurrent_itls(
                     lambda ids: grpc_times(cluster.address, ids, args.max_tokens), batch),
                 "http": lambda batch: concurrent_itls(
                     lambda ids: http_times(status.http_address, status.model, ids,
                                            args.max_tokens), batch)}
        for run in range(args.runs + 1):  # run 0 warms every path up and is not counted
            for c in args.concurrency:
                for path in results:  # alternating paths: drift hits each alike
                    got = fetch[path](prompts(c, args.prompt_tokens, first))
                    first += c
                    if run:
                        results[path].setdefault(c, []).extend(got)
    return results


def table(results: dict[str, dict[int, list[float]]], args: argparse.Namespace) -> list[str]:
    lines = [f"Machine: {cpu_model()}; {args.dtype}; {args.threads} torch threads; prompts of "
             f"{args.prompt_tokens} tokens, {args.max_tokens} output tokens; medians over "
             f"requests of {args.runs} runs.", "",
             "| path | " + " | ".join(f"ITL p50, {c} at once" for c in args.concurrency) + " |",
             "|---|" + "---|" * len(args.concurrency)]
    for path, by_c in results.items():
        cells = [f"{statistics.median(by_c[c]) * 1e3:.1f} ms" if by_c.get(c) else "-"
                 for c in args.concurrency]
        lines.append(f"| {path} | " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=lambda v: [int(x) for x in v.split(",")],
                   default=[1, 4])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    results = measure(args)
    print("\n".join(table(results, args)))
    if args.json:
        args.json.write_text(json.dumps({str(k): v for k, v in results.items()}, indent=1))


if __name__ == "__main__":
    main()

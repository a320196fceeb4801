"""TTFT and inter-token latency through a local cluster, for several topologies in one run.

    .venv/bin/python -m benchmarks.cluster_latency [--topologies 1p1d,2p2d,colocated]
        [--requests 17] [--max-tokens 32] [--runs 3]

Each topology gets its own cluster (1 torch thread per worker); the same prompts (16 mixed-length
workload prompts + one ~1,800-token document) are streamed concurrently, greedy. Reports medians
over runs of the per-run p50/p90/p99. Not a timed test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

TOPOLOGIES = {"1p1d": dict(prefill=1, decode=1), "2p2d": dict(prefill=2, decode=2),
              "colocated": dict(prefill=0, decode=0, colocated=1)}


def prompts(n: int) -> list[list[int]]:
    import json

    from loadtest.workloads import OFFLINE_MIXED, ONLINE_MIXED

    offline = [json.loads(x)["prompt_token_ids"] for x in OFFLINE_MIXED.open()]
    online = [json.loads(x)["prompt_token_ids"] for x in ONLINE_MIXED.open()]
    lengths = [3, 12, 17, 31, 48, 64, 100, 128, 150, 200, 256, 300, 333, 380, 400, 440]
    picked = [offline[i % len(offline)][:lengths[i % len(lengths)]] for i in range(n - 1)]
    return picked + [max(online, key=len)]


def one_stream(address: str, ids: list[int], max_tokens: int) -> tuple[float, list[float]]:
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
        max_tokens=max_tokens, temperature=0, ignore_eos=True))
    start = time.perf_counter()
    times = []
    with channel(address) as ch:
        for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=600):
            times.extend([time.perf_counter()] * len(part.token_ids))
    return times[0] - start, [b - a for a, b in zip(times, times[1:])]


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_topology(name: str, batch: list[list[int]], max_tokens: int, runs: int) -> dict:
    spec = ClusterSpec(port=0, kv_cache_gb=0.5, dtype="float32", **TOPOLOGIES[name])
    rows = []
    with LocalCluster(spec, Path(tempfile.mkdtemp()) / "logs") as cluster:
        one_stream(cluster.address, batch[0], 4)  # warm-up
        for run in range(runs):
            # A distinct first token per run: no run reuses another's prefix-cached blocks.
            fresh = [[1000 + run] + p for p in batch]
            start = time.perf_counter()
            with ThreadPoolExecutor(len(fresh)) as pool:
                results = list(pool.map(lambda p: one_stream(cluster.address, p, max_tokens),
                                        fresh))
            wall = time.perf_counter() - start
            ttft = [r[0] for r in results]
            itl = [gap for r in results for gap in r[1]]
            rows.append({"ttft": [pct(ttft, q) for q in (0.5, 0.9, 0.99)],
                         "itl": [pct(itl, q) for q in (0.5, 0.9, 0.99)],
                         "tok_s": len(batch) * max_tokens / wall})
    return {"ttft": [statistics.median(r["ttft"][i] for r in rows) for i in range(3)],
            "itl": [statistics.median(r["itl"][i] for r in rows) for i in range(3)],
            "tok_s": statistics.median(r["tok_s"] for r in rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="1p1d,2p2d,colocated")
    parser.add_argument("--requests", type=int, default=17)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    batch = prompts(args.requests)
    print(f"{len(batch)} concurrent greedy streams, {sum(map(len, batch))} prompt tokens, "
          f"{args.max_tokens} output tokens each; medians of {args.runs} runs\n")
    print("| topology | TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | output tok/s |")
    print("|---|---|---|---|")
    for name in args.topologies.split(","):
        r = run_topology(name, batch, args.max_tokens, args.runs)
        ms = lambda xs: " / ".join(f"{x * 1000:,.0f}" for x in xs)  # noqa: E731
        print(f"| {name} | {ms(r['ttft'])} | {ms(r['itl'])} | {r['tok_s']:.1f} |", flush=True)


if __name__ == "__main__":
    main()

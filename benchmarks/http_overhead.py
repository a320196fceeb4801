"""What the OpenAI-compatible HTTP API costs beside gRPC, measured side by side in one run.

    .venv/bin/python -m benchmarks.http_overhead [--requests 20] [--max-tokens 32] [--write]

One 1P+1D cluster (default model, float32, 1 thread per worker). The same greedy requests (real
chat turns of online_mixed.jsonl, streamed) go alternately through gRPC `Generate` and HTTP
`POST /v1/completions` with `stream: true`, one at a time; per request the client measures TTFT
(sent -> first token message / first SSE event with text) and the mean gap after it, and the
router's `timings.ttft_s` says how much of TTFT the router saw. Every request starts with its own
token, so none hits a prefix cache. Medians per API. `--write` puts
the section into BENCHMARKS.md. Not a timed test.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import replace_marked
from benchmarks.kv_transfer import cpu_model
from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from loadtest.workloads import ONLINE_MIXED
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
WORKLOAD = ONLINE_MIXED
TITLE = "## OpenAI HTTP API beside gRPC"
START, END = "<!-- http-overhead:start -->", "<!-- http-overhead:end -->"


def via_grpc(stub: pb_grpc.GenerationStub, ids: list[int], max_tokens: int) -> dict:
    sent = time.perf_counter()
    times, server = [], 0.0
    for part in stub.Generate(pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingOptions(
                max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=300):
        if part.token_ids:
            times.append(time.perf_counter())
        if part.HasField("timings"):
            server = part.timings.ttft_s
    return _figures(sent, times, server)


def via_http(address: str, model: str, ids: list[int], max_tokens: int) -> dict:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    body = {"model": model, "prompt": ids, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    sent = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    reply = conn.getresponse()
    times, server = [], 0.0
    while line := reply.readline():
        if not line.startswith(b"data: {"):
            continue
        event = json.loads(line[6:])
        if event["choices"] and event["choices"][0]["text"]:
            times.append(time.perf_counter())
        server = event.get("timings", {}).get("ttft_s", server)
    conn.close()
    return _figures(sent, times, server)


def _figures(sent: float, times: list[float], server_ttft: float) -> dict:
    gaps = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - sent, "gap": statistics.mean(gaps) if gaps else 0.0,
            "server_ttft": server_ttft}


def run(requests: int, max_tokens: int) -> dict[str, list[dict]]:
    rows = [json.loads(line) for line in WORKLOAD.open()]
    prompts = [r["prompt_token_ids"] for r in rows if r["kind"] == "chat"][:requests]
    spec = ClusterSpec(prefill=1, decode=1, port=0, dtype="float32", kv_cache_gb=0.5)
    results: dict[str, list[dict]] = {"grpc": [], "http": []}
    with LocalCluster(spec, Path(tempfile.mkdtemp(prefix="http-bench-")) / "logs") as cluster:
        status = cluster.status()
        with channel(cluster.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            via_grpc(stub, [1, 2, 3], 4)  # warm-up, both paths
            via_http(status.http_address, status.model, [1, 2, 3], 4)
            for i, prompt in enumerate(prompts):  # alternate, so drift hits both alike
                order = ("grpc", "http") if i % 2 == 0 else ("http", "grpc")
                for k, api in enumerate(order):
                    ids = [1000 + 2 * i + k, *prompt]  # its own first token: no cache hit
                    figures = via_grpc(stub, ids, max_tokens) if api == "grpc" else \
                        via_http(status.http_address, status.model, ids, max_tokens)
                    results[api].append(figures)
    return results


def section(results: dict[str, list[dict]], command: str) -> list[str]:
    med = {api: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for api, rs in results.items()}
    lines = [f"Machine: {cpu_model()}, 2 cores, CPU only; one 1P+1D cluster, the same "
             f"{len(results['grpc'])} requests through each API, alternating.", "",
             f"```bash\n{command}\n```", "",
             "| API | TTFT p50 ms (client) | TTFT p50 ms (router's `ttft_s`) | mean gap p50 ms |",
             "|---|---|---|---|"]
    for api, m in med.items():
        lines.append(f"| {api} | {m['ttft'] * 1e3:,.1f} | {m['server_ttft'] * 1e3:,.1f} | "
                     f"{m['gap'] * 1e3:,.1f} |")
    d_ttft = (med["http"]["ttft"] - med["grpc"]["ttft"]) * 1e3
    d_gap = (med["http"]["gap"] - med["grpc"]["gap"]) * 1e3
    lines += ["", f"HTTP − gRPC: TTFT {d_ttft:+.1f} ms, mean inter-token gap {d_gap:+.1f} ms "
              "(medians)."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--write", action="store_true")
    args = parser.parse_args()
    body = section(run(args.requests, args.max_tokens),
                   ".venv/bin/python -m benchmarks.http_overhead " + " ".join(sys.argv[1:]))
    print("\n".join(body))
    if args.write:
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_marked(path.read_text(), body, TITLE, START, END))

if __name__ == "__main__":
    main()

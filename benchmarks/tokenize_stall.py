"""How long one huge input holds up other clients' token streams (issue 27, part 4).

    .venv/bin/python -m benchmarks.tokenize_stall [--chars 1000000] [--repeats 3] [--json FILE]

One 1P+1D cluster (default model, float32, 1 thread per worker). A streaming request runs
(gRPC, greedy, EOS ignored, 300 tokens); once it has streamed 20 tokens, one huge chat message
of `--chars` characters (real text, repeated) goes to the router, over gRPC and then over HTTP.
Per case: the longest gap between two token messages of the running stream while the huge
request was being answered, and how long its answer took, next to the longest gap of the same
stream with nothing else sent. Medians over `--repeats`. The "before" figures in BENCHMARKS.md
ran this script as of bb55997 (before the modules moved) from a worktree of the earlier commit.
"""

from __future__ import annotations

import argparse
import http.client
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import grpc

from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

WARM_TOKENS = 20


def huge_text(chars: int) -> str:
    import pydoc_data.topics

    base = "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))
    return (base * (chars // len(base) + 1))[:chars]


class Stream(threading.Thread):
    """A running greedy stream; `times` holds each token message's arrival."""

    def __init__(self, address: str, prompt: list[int]):
        super().__init__(daemon=True)
        self.address, self.prompt = address, prompt
        self.times: list[float] = []
        self.warm = threading.Event()

    def run(self) -> None:
        with channel(self.address) as ch:
            for part in pb_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    prompt_token_ids=pb.TokenIds(ids=self.prompt), sampling=pb.SamplingOptions(
                        max_tokens=300, temperature=0, ignore_eos=True)), timeout=600):
                if part.token_ids:
                    self.times.append(time.perf_counter())
                if len(self.times) == WARM_TOKENS:
                    self.warm.set()

    def longest_gap(self, start: float, end: float) -> float:
        gaps = [b - a for a, b in zip(self.times, self.times[1:]) if b > start and a < end]
        return max(gaps, default=float("nan"))


def send_grpc(address: str, text: str) -> str:
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content=text)])
    with channel(address) as ch:
        try:
            pb_grpc.GenerationStub(ch).Complete(pb.GenerateRequest(
                chat=chat, sampling=pb.SamplingOptions(max_tokens=1)), timeout=600)
            return "OK"
        except grpc.RpcError as exc:
            return exc.code().name


def send_http(address: str, model: str, text: str) -> str:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=600)
    conn.request("POST", "/v1/chat/completions", json.dumps(
        {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]}),
        {"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return str(status)


def one_case(cluster: LocalCluster, prompt: list[int], send: object) -> dict:
    """The running stream's longest gap while `send` (None: nothing) is answered."""
    stream = Stream(cluster.address, prompt)
    stream.start()
    stream.warm.wait(120)
    start = time.perf_counter()
    answer = send() if send is not None else (time.sleep(3.0) or "none")  # type: ignore[operator]
    end = time.perf_counter()
    stream.join(600)
    return {"gap_ms": stream.longest_gap(start, end) * 1e3, "answer_s": end - start,
            "answer": answer}


def run(chars: int, repeats: int) -> dict:
    text = huge_text(chars)
    spec = ClusterSpec(prefill=1, decode=1, port=0, dtype="float32", kv_cache_gb=0.5,
                       ready_timeout_s=300.0)
    results: dict[str, list[dict]] = {"nothing": [], "grpc": [], "http": []}
    with tempfile.TemporaryDirectory() as logs, LocalCluster(spec, Path(logs)).start() as cluster:
        status = cluster.status()
        cases = {"nothing": None,
                 "grpc": lambda: send_grpc(cluster.address, text),
                 "http": lambda: send_http(status.http_address, status.model, text)}
        for repeat in range(repeats):
            for name, send in cases.items():
                prompt = [1000 + 7 * repeat + len(name), 42, 43, 44]  # no prefix-cache hit
                results[name].append(one_case(cluster, prompt, send))
    summary = {name: {"gap_ms_p50": statistics.median(r["gap_ms"] for r in rows),
                      "answer_s_p50": statistics.median(r["answer_s"] for r in rows),
                      "answers": sorted({r["answer"] for r in rows})}
               for name, rows in results.items()}
    return {"chars": chars, "repeats": repeats, "summary": summary, "runs": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chars", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    result = run(args.chars, args.repeats)
    print(json.dumps(result["summary"], indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

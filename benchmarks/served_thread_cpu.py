"""Where a served stream's CPU goes, thread by thread: the CPU seconds each process of the
colocated cluster (and the client) spends while N streams run at once, over the router's gRPC
API or its OpenAI HTTP API (`/v1/completions` with server-sent events, what `vllm bench serve`
reads).

    .venv/bin/python -m benchmarks.served_thread_cpu [--concurrency 16] [--prompt-tokens 256]
        [--max-tokens 128] [--dtype float32] [--threads 2] [--runs 2] [--api grpc] [--json OUT]

On a machine whose cores all run the worker's compute (its step-loop thread and the OpenMP team
it leads), every CPU second spent elsewhere — the worker's gRPC threads, the router, the client —
is taken from that team, and a step waits for the thread that lost its core. This splits each
process's CPU per thread from `/proc/PID/task/TID/stat` around each run: the worker's busiest
`--threads` threads are its compute, the rest its messaging; the router and the client count
whole (their exited threads included). Per run: wall time, ITL p50 (median over requests of
each request's median gap), and CPU seconds and microseconds per streamed token for each part.
Run 0 warms the paths up and is not reported.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

from benchmarks.kv_transfer import cpu_model
from benchmarks.served_token_path import grpc_times, http_times, itl, prompts

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
API_NAMES = {"grpc": "gRPC", "http": "HTTP (SSE)"}


def parse_stat(text: str) -> tuple[str, float]:
    """A `/proc/.../stat` line's command name and its CPU seconds (user + system)."""
    name = text[text.index("(") + 1:text.rindex(")")]
    fields = text[text.rindex(")") + 2:].split()
    return name, (int(fields[11]) + int(fields[12])) / TICKS_PER_S


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds of each live thread of `pid`, by thread id."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out[int(tid)] = parse_stat(Path(f"/proc/{pid}/task/{tid}/stat").read_text())[1]
        except OSError:  # the thread ended meanwhile
            continue
    return out


def process_cpu(pid: int) -> float:
    """CPU seconds of the whole process, threads that already ended included."""
    return parse_stat(Path(f"/proc/{pid}/stat").read_text())[1]


def split_compute(before: dict[int, float], after: dict[int, float], compute_threads: int
                  ) -> tuple[float, float]:
    """(compute, the rest): the busiest `compute_threads` threads' CPU seconds over the interval,
    and every other thread's."""
    spent = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return sum(spent[:compute_threads]), sum(spent[compute_threads:])


@dataclass
class RunCpu:
    wall_s: float
    itl_p50_ms: float
    tokens: int
    worker_compute_s: float
    worker_messaging_s: float
    router_s: float
    client_s: float

    def per_token_us(self, seconds: float) -> float:
        return seconds / self.tokens * 1e6


def one_run(fetch: Callable[[list[int]], list[float]], pids: dict[str, int],
            batch: list[list[int]], compute_threads: int) -> RunCpu:
    me = os.getpid()
    threads_before = thread_cpu(pids["worker"])
    before = {name: process_cpu(pid) for name, pid in pids.items()} | {"client": process_cpu(me)}
    started = time.perf_counter()
    with ThreadPoolExecutor(len(batch)) as pool:
        times = list(pool.map(fetch, batch))
    wall = time.perf_counter() - started
    after = {name: process_cpu(pid) for name, pid in pids.items()} | {"client": process_cpu(me)}
    compute, messaging = split_compute(threads_before, thread_cpu(pids["worker"]),
                                       compute_threads)
    return RunCpu(wall, statistics.median(itl(t) for t in times) * 1e3,
                  sum(len(t) for t in times), compute, messaging,
                  after["router"] - before["router"], after["client"] - before["client"])


def measure(args: argparse.Namespace) -> list[RunCpu]:
    from launch.cluster import ClusterSpec, LocalCluster

    spec = ClusterSpec(prefill=0, decode=0, colocated=1, port=0, threads=args.threads,
                       dtype=args.dtype)
    runs: list[RunCpu] = []
    first = 1000
    with LocalCluster(spec, Path(tempfile.mkdtemp(prefix="thread-cpu-")) / "logs") as cluster:
        pids = {"router": cluster.processes["router"].pid,
                "worker": cluster.processes["colocated-0"].pid}
        status = cluster.status()
        fetch = {"grpc": lambda ids: grpc_times(cluster.address, ids, args.max_tokens),
                 "http": lambda ids: http_times(status.http_address, status.model, ids,
                                                args.max_tokens)}[args.api]
        for run in range(args.runs + 1):
            batch = prompts(args.concurrency, args.prompt_tokens, first)
            first += args.concurrency
            got = one_run(fetch, pids, batch, args.threads)
            if run:
                runs.append(got)
    return runs


def table(runs: list[RunCpu], args: argparse.Namespace) -> list[str]:
    lines = [f"Machine: {cpu_model()}; {args.dtype}; {args.threads} torch threads; "
             f"{args.concurrency} {API_NAMES[args.api]} streams of {args.prompt_tokens}-token "
             f"prompts and "
             f"{args.max_tokens} output tokens.", "",
             "| run | wall s | ITL p50 ms | worker compute cpu-s | worker messaging cpu-s "
             "(µs/token) | router cpu-s (µs/token) | client cpu-s (µs/token) |",
             "|---|---|---|---|---|---|---|"]
    for i, r in enumerate(runs, 1):
        lines.append(
            f"| {i} | {r.wall_s:.2f} | {r.itl_p50_ms:.1f} | {r.worker_compute_s:.2f} | "
            f"{r.worker_messaging_s:.2f} ({r.per_token_us(r.worker_messaging_s):.0f}) | "
            f"{r.router_s:.2f} ({r.per_token_us(r.router_s):.0f}) | "
            f"{r.client_s:.2f} ({r.per_token_us(r.client_s):.0f}) |")
    return lines


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=int, default=2)
    p.add_argument("--api", default="grpc", choices=sorted(API_NAMES),
                   help="the router API the client streams from")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    runs = measure(args)
    print("\n".join(table(runs, args)))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in runs], indent=1))


if __name__ == "__main__":
    main()

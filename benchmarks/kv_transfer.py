"""KV hand-over from a prefill worker to a decode worker, per transport, against a plain memcpy.

    .venv/bin/python -m benchmarks.kv_transfer [--lengths 128,1024,2048,4096] [--requests 5]
        [--transports shared,shared-whole,dist] [--write]

One 1P+1D cluster per variant (default model, float32, 1 torch thread per worker, every prompt
prefilled on the prefill worker: --local-prefill off), started once. `shared` and `dist` stream a
prompt's KV chunk by chunk while later chunks compute (the default); `shared-whole` and
`dist-whole` are the same transports with --kv-streaming off (everything after the first token);
one warm-up request, then `--requests` greedy requests of each prompt length (real text from
offline_mixed.jsonl, each starting with its own token: no prefix-cache hit), max_tokens=2 (with 1
nothing is shipped). Each request's last message gives the bytes moved, the hand-over's seconds
as the prefill worker waits for it, the transport and the TTFT. The baseline is `dst.copy_(src)`
of as many bytes in this process (1 thread). `--write` puts the section into BENCHMARKS.md.
Not a timed test: numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from benchmarks.common import replace_marked
from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from loadtest.workloads import OFFLINE_MIXED
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## KV transfer by transport"
START, END = "<!-- kv-transfer:start -->", "<!-- kv-transfer:end -->"
MEMCPY_TARGET, MEMCPY_MIN_TOKENS = 0.70, 1024  # shared >= 70% of memcpy for 1k+ tokens
TTFT_TARGET, TTFT_TOKENS = 0.05, (1024, 2048)  # transfer <= 5% of TTFT at 1k and 2k tokens
VARIANTS = {"shared": ("shared", "on"), "shared-whole": ("shared", "off"),
            "dist": ("dist", "on"), "dist-whole": ("dist", "off")}  # (transport, --kv-streaming)
REQUEST_TIMEOUT_S = 600.0  # one request (a 4k-token prefill on one core takes tens of seconds)
MEMCPY_RUNS = 7


@dataclass(frozen=True)
class Sample:
    transport: str
    tokens: int
    num_bytes: int
    transfer_s: float
    ttft_s: float


def text_tokens() -> list[int]:
    """Every prompt of the offline workload, concatenated: real text token ids."""
    rows = OFFLINE_MIXED.read_text().splitlines()
    return [t for line in rows if line.strip() for t in json.loads(line)["prompt_token_ids"]]


def make_prompt(stream: list[int], length: int, first: int, offset: int) -> list[int]:
    """`first`, then `length - 1` tokens of the stream from `offset` (wrapping around)."""
    body = [stream[(offset + i) % len(stream)] for i in range(length - 1)]
    return [first, *body]


def generate(address: str, ids: list[int], rid: str) -> pb.Timings:
    """Stream one greedy 2-token request; the timings of its last message."""
    request = pb.GenerateRequest(
        request_id=rid, prompt_token_ids=pb.TokenIds(ids=ids),
        sampling=pb.SamplingOptions(max_tokens=2, temperature=0, ignore_eos=True))
    last = None
    with channel(address) as ch:
        for part in pb_grpc.GenerationStub(ch).Generate(request, timeout=REQUEST_TIMEOUT_S):
            last = part
    if last is None or not last.HasField("timings"):
        raise RuntimeError(f"request {rid}: no timings in the last message")
    return last.timings


def run_transport(variant: str, lengths: list[int], requests: int, stream: list[int],
                  firsts: Iterator[int], device: str = "cpu") -> list[Sample]:
    """One cluster for the variant (VARIANTS), started once: a warm-up, then every length. On
    `device` cuda both workers share one GPU (the shared transport is then CUDA IPC)."""
    transport, streaming = VARIANTS[variant]
    gpus = {"device": "cuda", "gpus": 1} if device == "cuda" else {}
    spec = ClusterSpec(prefill=1, decode=1, port=0, threads=1, dtype="float32", **gpus,
                       kv_cache_gb=0.5, kv_transport=transport, ready_timeout_s=240.0,
                       worker_args=("--kv-streaming", streaming),
                       router_args=("--local-prefill", "off"))
    samples = []
    with LocalCluster(spec, Path(tempfile.mkdtemp(prefix="kv-bench-")) / "logs") as cluster:
        generate(cluster.address, make_prompt(stream, 128, next(firsts), 0), f"{variant}-w")
        for length in lengths:
            for i in range(requests):
                ids = make_prompt(stream, length, next(firsts), i * 997)
                t = generate(cluster.address, ids, f"{variant}-{length}-{i}")
                if t.kv_transport != transport:
                    raise RuntimeError(f"asked for {transport!r}, the KV moved over "
                                       f"{t.kv_transport!r}")
                if t.kv_transfer_bytes == 0 or t.kv_transfer_s <= 0:
                    raise RuntimeError(f"request {variant}-{length}-{i} shipped no KV")
                samples.append(Sample(variant, length, t.kv_transfer_bytes, t.kv_transfer_s,
                                      t.ttft_s))
                print(f"  {variant} {length} tokens #{i}: {t.kv_transfer_bytes / 1e6:.1f} MB "
                      f"in {t.kv_transfer_s * 1e3:.1f} ms, TTFT {t.ttft_s:.2f} s", flush=True)
    return samples


def memcpy_seconds(num_bytes: int, runs: int = MEMCPY_RUNS, device: str = "cpu") -> float:
    """Median seconds of `dst.copy_(src)` over `num_bytes` of pre-touched float32 (1 thread on
    CPU; on a GPU, device to device, synchronized)."""
    import torch

    torch.set_num_threads(1)
    numel = max(1, num_bytes // 4)
    src = torch.ones(numel, dtype=torch.float32, device=device)
    dst = torch.zeros(numel, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(runs):
        sync()
        start = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gbps(num_bytes: float, seconds: float) -> float:
    return num_bytes / seconds / 1e9 if seconds > 0 else float("nan")


def summarize(samples: list[Sample], memcpy_s: dict[int, float]) -> list[dict]:
    """One row per (transport, length), in order of appearance: medians of its requests."""
    rows = []
    keys = list(dict.fromkeys((s.transport, s.tokens) for s in samples))
    for transport, tokens in keys:
        group = [s for s in samples if (s.transport, s.tokens) == (transport, tokens)]
        num_bytes = statistics.median(s.num_bytes for s in group)
        seconds = statistics.median(s.transfer_s for s in group)
        rate = gbps(num_bytes, seconds)
        copy_rate = gbps(num_bytes, memcpy_s[tokens]) if tokens in memcpy_s else float("nan")
        rows.append({"transport": transport, "tokens": tokens, "n": len(group),
                     "mb": num_bytes / 1e6, "transfer_s": seconds, "gbps": rate,
                     "memcpy_gbps": copy_rate, "ratio": rate / copy_rate,
                     "ttft_s": statistics.median(s.ttft_s for s in group),
                     "share": statistics.median(s.transfer_s / s.ttft_s for s in group)})
    return rows


def table(rows: list[dict]) -> list[str]:
    lines = ["| transport | prompt tokens | n | KV MB | transfer ms | GB/s | memcpy GB/s "
             "| of memcpy | TTFT ms | transfer / TTFT |", "|---" * 10 + "|"]
    for r in rows:
        lines.append(f"| {r['transport']} | {r['tokens']:,} | {r['n']} | {r['mb']:.1f} | "
                     f"{r['transfer_s'] * 1e3:,.1f} | {r['gbps']:.2f} | {r['memcpy_gbps']:.2f} | "
                     f"{r['ratio']:.0%} | {r['ttft_s'] * 1e3:,.0f} | {r['share']:.2%} |")
    return lines


def verdicts(rows: list[dict]) -> list[str]:
    """The issue's targets, each with what was measured and whether it was met."""
    lines = ["| target | measured | met |", "|---|---|---|"]
    # The copy rate shows where the copy is whole (streamed copies overlap the prefill).
    whole = "shared-whole" if any(r["transport"] == "shared-whole" for r in rows) else "shared"
    big = [r for r in rows if r["transport"] == whole and r["tokens"] >= MEMCPY_MIN_TOKENS]
    measured = ", ".join(f"{r['ratio']:.0%} at {r['tokens']:,} tokens" for r in big)
    met = all(r["ratio"] >= MEMCPY_TARGET for r in big)
    lines.append(f"| {whole} transport ≥{MEMCPY_TARGET:.0%} of memcpy, "
                 f"{MEMCPY_MIN_TOKENS:,}+ tokens | {measured or 'not measured'} | "
                 f"{('yes' if met else 'no') if big else '—'} |")
    at = [r for r in rows if r["tokens"] in TTFT_TOKENS]
    for r in at:
        lines.append(f"| transfer ≤{TTFT_TARGET:.0%} of TTFT at {r['tokens']:,} tokens, "
                     f"{r['transport']} | {r['share']:.2%} | "
                     f"{'yes' if r['share'] <= TTFT_TARGET else 'no'} |")
    if not at:
        lengths = " and ".join(f"{n:,}" for n in TTFT_TOKENS)
        lines.append(f"| transfer ≤{TTFT_TARGET:.0%} of TTFT at {lengths} tokens | "
                     "not measured | — |")
    return lines


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in out.splitlines()
             if line.startswith("Model name")]
    return names[0] if names else "unknown CPU"


def section(rows: list[dict], command: str, requests: int, wall_s: float,
            device: str = "cpu") -> list[str]:
    import torch

    accelerator = (f"KV on {torch.cuda.get_device_name(device)}" if device.startswith("cuda")
                   else "CPU only")
    return [
        f"Machine: {cpu_model()} (`lscpu` model name), {os.cpu_count()} cores, {accelerator}, "
        f"torch {torch.__version__}; {datetime.date.today().isoformat()}; "
        f"{wall_s / 60:.1f} min in all. Every process (router, both workers, this client) "
        "shares these cores.", "",
        f"```bash\n{command}\n```", "",
        "One 1P+1D cluster per transport (default model, float32, 1 torch thread per worker, "
        f"KV cache 0.5 GB each); medians of {requests} greedy requests per row (real text, "
        "each with its own first token: no prefix-cache hit; 2 output tokens; one warm-up "
        "request per cluster not counted).", "",
        *table(rows), "",
        "KV MB = bytes shipped (10⁶); transfer = `timings.kv_transfer_s`, the hand-over the "
        "request waits for after its first token (control RPCs, copy or send, "
        "acknowledgement; streamed — `shared`, `dist` — only the blocks not yet sent while the "
        "prompt computed, so their GB/s is not a transfer rate); "
        "GB/s = bytes / transfer s; memcpy = `dst.copy_(src)` of as many bytes between two "
        f"pre-touched float32 tensors in the benchmark process, 1 thread, median of "
        f"{MEMCPY_RUNS} (bytes copied per second: memory traffic is twice that); "
        "transfer / TTFT = median over requests of kv_transfer_s / ttft_s.", "",
        *verdicts(rows)]


def replace_section(text: str, body: list[str]) -> str:
    """`text` with this benchmark's section replaced (or appended)."""
    return replace_marked(text, body, TITLE, START, END)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", default="128,1024,2048,4096")
    parser.add_argument("--requests", type=int, default=5)
    parser.add_argument("--transports", default="shared,shared-whole,dist,dist-whole",
                        help=f"variants, of {', '.join(VARIANTS)}")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: both workers on one GPU (shared = CUDA IPC; dist refused)")
    parser.add_argument("--json", type=Path, default=None, help="write the rows here too")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    started = time.perf_counter()
    stream, firsts = text_tokens(), itertools.count(1000)
    samples = []
    variants = args.transports.split(",")
    if unknown := [v for v in variants if v not in VARIANTS]:
        parser.error(f"--transports: unknown {unknown}; choose from {list(VARIANTS)}")
    for variant in variants:
        print(f"{variant}: starting a 1P+1D cluster", flush=True)
        samples += run_transport(variant, lengths, args.requests, stream, firsts, args.device)
    # The clusters are stopped: the baseline copies run on idle cores.
    memcpy_s = {n: memcpy_seconds(int(statistics.median(s.num_bytes for s in samples
                                                        if s.tokens == n)),
                                  device=args.device) for n in lengths}
    command = ".venv/bin/python -m benchmarks.kv_transfer " + " ".join(sys.argv[1:])
    body = section(summarize(samples, memcpy_s), command.strip(), args.requests,
                   time.perf_counter() - started, args.device)
    print("\n" + "\n".join(body))
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "rows": summarize(
            samples, memcpy_s)}, indent=2) + "\n")
    if args.write:
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_section(path.read_text(), body))


if __name__ == "__main__":
    main()

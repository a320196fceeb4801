"""Disaggregated vs colocated under open-loop Poisson arrivals, on the same cores.

    .venv/bin/python -m benchmarks.poisson [--topologies 1p1d,colocated2]
        [--rates 0.15,0.3,0.6,1.2] [--requests 16] [--max-tokens-cap 64]
        [--ttft-slo-s 4] [--tpot-slo-s 0.2] [--repeats 1] [--json PATH] [--write]
    .venv/bin/python -m benchmarks.poisson --from-json PATH [--write] [SLO and run options]

Each topology gets its own cluster (1 torch thread per worker: 1P+1D = 2 cores, 2 colocated
workers = 2 cores). For each rate, `--requests` requests drawn from online_mixed.jsonl arrive
with exponential gaps (seeded; the same arrivals and prompts for every topology; a disjoint slice
of the workload per rate, so no rate reuses another's prefix cache). Per request: TTFT, its
inter-token gaps, TPOT (mean gap) and whether it met both SLOs; goodput = requests/s meeting
both. With `--repeats R` each rate runs R times on fresh requests and the report shows medians.
`--write` puts the section and plots into BENCHMARKS.md. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import grpc

from benchmarks.poisson_report import Outcome, report
from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from loadtest.workloads import ONLINE_MIXED
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

TOPOLOGIES = {"1p1d": dict(prefill=1, decode=1), "colocated2": dict(prefill=0, decode=0,
                                                                    colocated=2),
              "colocated1": dict(prefill=0, decode=0, colocated=1)}
WORKLOAD = ONLINE_MIXED


def plan(rates: list[float], n: int, cap: int, seed: int, repeats: int = 1
         ) -> list[list[list[tuple[float, dict]]]]:
    """Per rate, per repeat: (arrival time, workload row) pairs. Every (rate, repeat) run gets
    its own rows, so no run reuses another's prefix-cached blocks."""
    rows = [json.loads(line) for line in WORKLOAD.open()]
    rng = random.Random(seed)
    rng.shuffle(rows)
    if n * len(rates) * repeats > len(rows):
        raise ValueError(f"{n} requests x {len(rates)} rates x {repeats} repeats exceeds the "
                         f"{len(rows)} rows")
    plans = []
    for i, rate in enumerate(rates):
        runs = []
        for r in range(repeats):
            k = i * repeats + r
            t, arrivals = 0.0, []
            for row in rows[k * n:(k + 1) * n]:
                t += rng.expovariate(rate)
                arrivals.append((t, dict(row, max_tokens=min(cap, int(row["max_tokens"])))))
            runs.append(arrivals)
        plans.append(runs)
    return plans


def _one(stub: pb_grpc.GenerationStub, row: dict, start: float, out: Outcome) -> None:
    request = pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=row["prompt_token_ids"]),
                                 sampling=pb.SamplingOptions(max_tokens=row["max_tokens"],
                                                             temperature=0,
                                                             ignore_eos=row["ignore_eos"]))
    sent = last = time.perf_counter()
    try:
        for part in stub.Generate(request, timeout=900):
            now = time.perf_counter()
            if part.token_ids:
                if out.ttft is None:
                    out.ttft = now - sent
                else:
                    out.gaps.append(now - last)
                last = now
                out.tokens += len(part.token_ids)
        out.end = time.perf_counter() - start
    except grpc.RpcError as exc:
        out.error = exc.code().name


def run_rate(address: str, arrivals: list[tuple[float, dict]]) -> list[Outcome]:
    """Open loop: each request starts at its arrival time whatever the others are doing."""
    outcomes = [Outcome(t, row.get("kind", ""), len(row["prompt_token_ids"]))
                for t, row in arrivals]
    threads = []
    with channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        start = time.perf_counter()
        for (t, row), out in zip(arrivals, outcomes):
            time.sleep(max(0.0, start + t - time.perf_counter()))
            thread = threading.Thread(target=_one, args=(stub, row, start, out), daemon=True)
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=1200)
    return outcomes


def run_topology(name: str, rates: list[float], plans: list, log_dir: Path
                 ) -> dict[float, list[list[Outcome]]]:
    spec = ClusterSpec(port=0, kv_cache_gb=0.5, dtype="float32", **TOPOLOGIES[name])
    results = {}
    with LocalCluster(spec, log_dir / name) as cluster:
        warm = [(0.0, dict(prompt_token_ids=[1, 2, 3], max_tokens=4, ignore_eos=True))]
        run_rate(cluster.address, warm)
        for rate, runs in zip(rates, plans):
            results[rate] = []
            for i, arrivals in enumerate(runs):
                results[rate].append(run_rate(cluster.address, arrivals))
                print(f"  {name} @ {rate} req/s: run {i + 1}/{len(runs)} done", flush=True)
    return results


def load_results(path: Path) -> dict[str, dict[float, list[list[Outcome]]]]:
    saved = json.loads(path.read_text())
    return {name: {float(rate): [[Outcome(**o) for o in run] for run in runs]
                   for rate, runs in by_rate.items()}
            for name, by_rate in saved.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--topologies", default="1p1d,colocated2")
    parser.add_argument("--rates", default="0.15,0.3,0.6,1.2")
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens-cap", type=int, default=64)
    parser.add_argument("--ttft-slo-s", type=float, default=4.0)
    parser.add_argument("--tpot-slo-s", type=float, default=0.2)
    parser.add_argument("--max-gap-slo-s", type=float, default=None,
                        help="also count a request as met only when no gap exceeds this")
    parser.add_argument("--repeats", type=int, default=1,
                        help="runs per rate (each with its own requests); medians reported")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md + plots")
    parser.add_argument("--json", type=Path, default=None, help="save every request's outcome")
    parser.add_argument("--from-json", type=Path, default=None,
                        help="report a saved run (--json) again instead of measuring")
    args = parser.parse_args()
    if args.from_json is not None:
        report(load_results(args.from_json), args, write=args.write)
        return
    rates = [float(r) for r in args.rates.split(",")]
    plans = plan(rates, args.requests, args.max_tokens_cap, args.seed, args.repeats)
    log_dir = Path(tempfile.mkdtemp(prefix="poisson-"))
    results = {name: run_topology(name, rates, plans, log_dir)
               for name in args.topologies.split(",")}
    if args.json is not None:
        args.json.write_text(json.dumps(
            {name: {str(rate): [[asdict(o) for o in run] for run in runs]
                    for rate, runs in by_rate.items()}
             for name, by_rate in results.items()}, indent=1))
    report(results, args, write=args.write)


if __name__ == "__main__":
    main()

"""The P:D planner: which split of N workers into prefill and decode workers (or colocated
workers), and whether the router should prefill short prompts on the decode workers, maximises
goodput for a workload at an SLO.

    python -m router plan --workload FILE --slo FILE --workers N [--rates 0.4,0.8]
        [--profile FILE] [--prefill-tp 1] [--decode-tp 1] [--tp-profile N=FILE ...]
        [--requests 400] [--seeds 5] [--max-tokens-cap 64] [--json OUT]

--workload: JSONL, one request per line: `prompt_token_ids` (or `prompt_tokens`, a count) and
`max_tokens` (the benchmarks' online_mixed.jsonl as it is). --slo: JSON `{"ttft_s": 8,
"tpot_s": 0.2}`. --profile: one worker's measured speed (`python -m engine.profile` writes it);
without it the planner measures one first (minutes, with the default model, 1 thread). Each
candidate serves the same Poisson arrivals in the model of planner.simulator; a request counts
when its TTFT and its mean inter-token gap both meet the SLO, goodput = those per second of the
run (benchmarks.poisson's definition).

Tensor parallelism per role: --workers then counts devices (cores, GPUs), a prefill worker at
--prefill-tp p takes p of them and a decode (or colocated) worker at --decode-tp d takes d; each
size's speed comes from a profile measured at that size (`python -m engine.profile
--tensor-parallel-size N`; --tp-profile N=FILE, measured now when missing).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from planner.simulator import ClusterSim, Profile, SimRequest, Topology

PROFILE_TIMEOUT_S = 1800.0


@dataclass(frozen=True)
class SLO:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SLO {name} must be > 0 seconds, got {getattr(self, name)}")

    @classmethod
    def load(cls, path: Path) -> SLO:
        data = json.loads(path.read_text())
        missing = {"ttft_s", "tpot_s"} - set(data)
        if missing:
            raise ValueError(f"{path}: SLO needs {sorted(missing)} (seconds)")
        return cls(float(data["ttft_s"]), float(data["tpot_s"]))

    def met(self, request: SimRequest) -> bool:
        ttft, tpot = request.ttft, request.tpot
        return ttft is not None and ttft <= self.ttft_s and (tpot is None or tpot <= self.tpot_s)


def load_workload(path: Path, cap: int | None) -> list[tuple[int, int]]:
    """(prompt tokens, max tokens) per request line."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        tokens = len(row["prompt_token_ids"]) if "prompt_token_ids" in row \
            else row.get("prompt_tokens")
        if not isinstance(tokens, int) or tokens < 1 or int(row.get("max_tokens", 0)) < 1:
            raise ValueError(f"{path}:{number}: needs prompt_token_ids (or prompt_tokens >= 1) "
                             f"and max_tokens >= 1")
        rows.append((tokens, min(int(row["max_tokens"]), cap or int(row["max_tokens"]))))
    if not rows:
        raise ValueError(f"{path}: no requests")
    return rows


def arrivals(rows: list[tuple[int, int]], rate: float, n: int, seed: int
             ) -> list[tuple[float, int, int]]:
    """`n` Poisson arrivals at `rate` req/s over rows drawn at random (seeded)."""
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append((t, *rng.choice(rows)))
    return out


def candidates(workers: int, prefill_tp: int = 1, decode_tp: int = 1) -> list[Topology]:
    """Every split of `workers` devices: colocated workers, and P:D splits (each worker taking
    its role's tensor-parallel size in devices; devices left over stay idle)."""
    if workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if prefill_tp < 1 or decode_tp < 1:
        raise ValueError(f"--prefill-tp and --decode-tp must be >= 1, got {prefill_tp} and "
                         f"{decode_tp}")
    if workers < decode_tp:
        raise ValueError(f"--workers {workers} cannot hold one worker at --decode-tp "
                         f"{decode_tp}")
    out = [Topology(colocated=workers // decode_tp, decode_tp=decode_tp)]
    for prefill in range(1, workers // prefill_tp + 1):
        decode = (workers - prefill * prefill_tp) // decode_tp
        if decode < 1:
            break
        for local in ("auto", "off"):
            out.append(Topology(prefill=prefill, decode=decode, local_prefill=local,
                                prefill_tp=prefill_tp, decode_tp=decode_tp))
    return out


def score(requests: list[SimRequest], slo: SLO) -> dict[str, float]:
    span = max((r.end or r.first_token or 0.0) for r in requests) or 1.0
    ttfts = sorted(r.ttft for r in requests if r.ttft is not None)
    gaps = sorted(g for r in requests for g in r.gaps)
    met = sum(slo.met(r) for r in requests)
    return {"goodput": met / span, "attainment": met / len(requests),
            "ttft_p50": _pct(ttfts, 0.5), "ttft_p90": _pct(ttfts, 0.9),
            "itl_p99": _pct(gaps, 0.99),
            "local": sum(r.site == "local" for r in requests) / len(requests)}


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if values else 0.0


def evaluate(topology: Topology, profile: Profile | Mapping[int, Profile],
             rows: list[tuple[int, int]], slo: SLO, rate: float, requests: int, seeds: int
             ) -> dict[str, float]:
    """Medians over `seeds` runs (each its own arrivals, the same for every topology)."""
    runs = [score(ClusterSim(topology, profile).run(arrivals(rows, rate, requests, seed)), slo)
            for seed in range(seeds)]
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def plan(profile: Profile | Mapping[int, Profile], rows: list[tuple[int, int]], slo: SLO,
         workers: int, rates: list[float], requests: int = 400, seeds: int = 5,
         prefill_tp: int = 1, decode_tp: int = 1) -> dict[float, list[dict]]:
    """Per rate: every candidate's figures, best goodput first (`profile`: a worker's speed, or
    one per tensor-parallel size)."""
    table = {}
    for rate in rates:
        results = [{"topology": t.name, "launch": t.launch_args,
                    **evaluate(t, profile, rows, slo, rate, requests, seeds)}
                   for t in candidates(workers, prefill_tp, decode_tp)]
        table[rate] = sorted(results, key=lambda r: (-r["goodput"], r["itl_p99"]))
    return table


def measure_profile(timeout_s: float = PROFILE_TIMEOUT_S, tensor_parallel_size: int = 1
                    ) -> Profile:
    """Measure one worker (default model, 1 thread per rank) in a child process (torch stays
    out of the router)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "profile.json"
        subprocess.run([sys.executable, "-m", "engine.profile", "--out", str(out),
                        "--tensor-parallel-size", str(tensor_parallel_size)], check=True,
                       timeout=timeout_s, stdout=subprocess.DEVNULL)
        return Profile.from_json(json.loads(out.read_text()))


def load_profiles(args: argparse.Namespace) -> dict[int, Profile]:
    """A profile for each tensor-parallel size the roles use: --profile (TP 1), --tp-profile
    N=FILE, or measured now."""
    files: dict[int, Path] = {1: args.profile} if args.profile else {}
    for item in args.tp_profile or []:
        size, sep, path = item.partition("=")
        if not sep or not size.isdigit() or int(size) < 1:
            raise ValueError(f"--tp-profile takes N=FILE (N >= 1), got {item!r}")
        files[int(size)] = Path(path)
    profiles = {}
    for size in sorted({args.prefill_tp, args.decode_tp}):
        path = files.get(size)
        profiles[size] = Profile.from_json(json.loads(path.read_text())) if path \
            else measure_profile(tensor_parallel_size=size)
    return profiles


def report(table: dict[float, list[dict]], slo: SLO, workers: int, devices: bool = False
           ) -> list[str]:
    """`devices`: --workers counts devices (tensor-parallel roles), not workers."""
    lines = [f"SLO: TTFT <= {slo.ttft_s:g} s and mean inter-token gap <= {slo.tpot_s:g} s; "
             f"{workers} {'devices' if devices else 'workers'}.", ""]
    for rate, results in table.items():
        best = results[0]
        lines += [f"rate {rate:g} req/s — recommended: {best['topology']} "
                  f"(`python -m router launch {best['launch']}`)", "",
                  "| topology | goodput req/s | SLO met | TTFT p50 / p90 s | ITL p99 ms "
                  "| prefilled locally |", "|---|---|---|---|---|---|"]
        lines += [f"| {r['topology']} | {r['goodput']:.3f} | {r['attainment']:.0%} | "
                  f"{r['ttft_p50']:.2f} / {r['ttft_p90']:.2f} | {r['itl_p99'] * 1e3:,.0f} | "
                  f"{r['local']:.0%} |" for r in results]
        lines.append("")
    return lines


def run_plan(args: argparse.Namespace) -> int:
    """`python -m router plan` (ValueError/OSError on bad files or values)."""
    slo = SLO.load(args.slo)
    if args.max_tokens_cap is not None and args.max_tokens_cap < 0:
        raise ValueError(f"--max-tokens-cap must be >= 0 (0: no cap), got {args.max_tokens_cap}")
    rows = load_workload(args.workload, args.max_tokens_cap)
    rates = [float(x) for x in args.rates.split(",")]
    if any(r <= 0 for r in rates) or args.requests < 1 or args.seeds < 1:
        raise ValueError("--rates must be > 0, --requests and --seeds >= 1")
    # Before the profiles: measuring one can take minutes, and a TP size of 0 failed in it.
    candidates(args.workers, args.prefill_tp, args.decode_tp)
    table = plan(load_profiles(args), rows, slo, args.workers, rates, args.requests, args.seeds,
                 args.prefill_tp, args.decode_tp)
    print("\n".join(report(table, slo, args.workers, max(args.prefill_tp, args.decode_tp) > 1)))
    if args.json is not None:
        args.json.write_text(json.dumps({str(rate): results for rate, results in table.items()},
                                        indent=2) + "\n")
    return 0

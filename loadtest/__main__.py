"""python -m loadtest {run,local} ...

  run    a headless Locust test against a running cluster (--address)
  local  start a local cluster, run the same test against it, stop the cluster

Both write Locust's CSV files and HTML report to --out, print the SLO verdict, and exit non-zero
when an SLO is missed (or no request completed). Every run is bounded in users, requests and
time, and targets loopback unless --address says otherwise."""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from loadtest.shapes import SHAPES, ShapeSpec
from loadtest.slo import SLO
from loadtest.workload import DEFAULT_WORKLOAD, MAX_REQUESTS_LIMIT

PACKAGE_DIR = Path(__file__).resolve().parent  # a checkout's loadtest/, or an installed one
LOCUSTFILE = PACKAGE_DIR / "locustfile.py"
DEFAULT_SLO = PACKAGE_DIR / "slo.yaml"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m loadtest", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "local"):
        p = sub.add_parser(name)
        if name == "run":
            p.add_argument("--address", default="127.0.0.1:50051", help="the router")
        else:
            p.add_argument("--prefill", type=int, default=1)
            p.add_argument("--decode", type=int, default=1)
            p.add_argument("--colocated", type=int, default=0)
            p.add_argument("--model", default="default")
            p.add_argument("--kv-cache-gb", type=float, default=None)
        p.add_argument("--api", default="grpc", choices=["grpc", "http"],
                       help="the router's gRPC API, or its OpenAI-compatible HTTP API (run: "
                            "--address is then the HTTP address, e.g. 127.0.0.1:8000)")
        p.add_argument("--slo", default=str(DEFAULT_SLO), help="SLO file (default: %(default)s)")
        p.add_argument("--workload", default=str(DEFAULT_WORKLOAD),
                       help="JSONL workload (default: the shipped %(default)s)")
        p.add_argument("--shape", default="constant", choices=SHAPES)
        p.add_argument("--users", type=int, default=4)
        p.add_argument("--spawn-rate", type=float, default=4.0)
        p.add_argument("--duration-s", type=float, default=60.0)
        p.add_argument("--max-requests", type=int, default=1000)
        p.add_argument("--max-tokens-cap", type=int, default=0)
        p.add_argument("--request-timeout-s", type=float, default=120.0)
        p.add_argument("--out", type=Path, default=Path("loadtest-results"))
    return parser


def locust_command(args: argparse.Namespace, address: str) -> list[str]:
    args.out.mkdir(parents=True, exist_ok=True)
    return [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
            "--host", address, "--csv", str(args.out / "locust"),
            "--html", str(args.out / "report.html"), "--only-summary",
            "--stop-timeout", str(int(args.request_timeout_s)),
            "--slo", args.slo, "--workload", args.workload, "--shape", args.shape,
            "--shape-users", str(args.users), "--shape-spawn-rate", str(args.spawn_rate),
            "--shape-duration-s", str(args.duration_s), "--max-requests", str(args.max_requests),
            "--max-tokens-cap", str(args.max_tokens_cap),
            "--request-timeout-s", str(args.request_timeout_s), "--api", args.api]


def check_options(args: argparse.Namespace) -> None:
    """What locust would refuse, refused before a cluster is started for nothing."""
    ShapeSpec(args.shape, args.users, args.spawn_rate, args.duration_s)
    SLO.from_yaml(args.slo)
    if not 1 <= args.max_requests <= MAX_REQUESTS_LIMIT:
        raise ValueError(f"--max-requests must be in [1, {MAX_REQUESTS_LIMIT}], got "
                         f"{args.max_requests}")
    if args.max_tokens_cap < 0:
        raise ValueError(f"--max-tokens-cap must be >= 0 (0: no cap), got {args.max_tokens_cap}")


def run_locust(args: argparse.Namespace, address: str) -> int:
    check_options(args)
    bound_s = args.duration_s + args.request_timeout_s + 60
    try:
        return subprocess.run(locust_command(args, address), cwd=PACKAGE_DIR.parent,
                              timeout=bound_s).returncode
    except subprocess.TimeoutExpired:
        print(f"locust did not end within {bound_s:.0f}s", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "run":
        return run_locust(args, args.address)
    from launch.cluster import ClusterSpec, LocalCluster

    check_options(args)
    # SIGTERM (a `timeout`, a supervisor) unwinds as Ctrl-C does: the cluster is stopped on the
    # way out, not left running.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    colocated = args.colocated
    spec = ClusterSpec(prefill=0 if colocated else args.prefill,
                       decode=0 if colocated else args.decode, colocated=colocated,
                       model=args.model, port=0, kv_cache_gb=args.kv_cache_gb)
    with LocalCluster(spec, log_dir=args.out / "logs").start() as cluster:
        address = cluster.status().http_address if args.api == "http" else cluster.address
        print(f"cluster ready on {address} ({args.api}); running the load test", flush=True)
        return run_locust(args, address)


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    sys.exit(main())

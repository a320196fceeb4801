"""python -m router {serve,launch,client,plan,certs,drain} ...

  serve   run the router alone (workers join with --router ADDRESS)
  launch  run a whole local cluster: router + prefill + decode workers (Ctrl-C stops it)
  client  stream a generation from a running cluster
  plan    recommend the P:D split (and local prefill on/off) for a workload and an SLO
  certs   write a throwaway CA and server certificate
  drain   move a worker's running requests (with their KV) off it; place nothing new there
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from common.logs import add_logging_args, configure_logging

if TYPE_CHECKING:
    from launch.cluster import ClusterSpec


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m router", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_serve_args(sub.add_parser("serve", help="run the router alone"))
    _add_launch_args(sub.add_parser("launch", help="run router + workers locally"))
    _add_client_args(sub.add_parser("client", help="stream a generation"))
    _add_certs_args(sub.add_parser("certs", help="write a throwaway CA and server certificate"))
    _add_plan_args(sub.add_parser("plan", help="recommend a P:D split for a workload and SLO"))
    _add_drain_args(sub.add_parser("drain", help="move a worker's running requests off it and "
                                                 "place nothing new there"))
    return parser


def _add_serve_args(serve: argparse.ArgumentParser) -> None:
    from security.tls import add_cluster_tls_args

    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=50051)
    serve.add_argument("--model", default="default")
    serve.add_argument("--heartbeat-timeout-s", type=float, default=3.0)
    serve.add_argument("--max-running", type=int, default=256,
                       help="requests served at once; more wait in the router's queue")
    serve.add_argument("--max-queued", type=int, default=1024,
                       help="requests waiting for a slot; beyond, RESOURCE_EXHAUSTED at once")
    serve.add_argument("--metrics-port", type=int, default=0,
                       help="Prometheus /metrics port (0: any free port, shown at start)")
    serve.add_argument("--http-port", type=int, default=8000,
                       help="OpenAI-compatible HTTP API port (on --host; 0 turns it off)")
    _add_tls_args(serve, server=True)
    serve.add_argument("--insecure", action="store_true",
                       help="plaintext beyond loopback is intended: do not warn")
    serve.add_argument("--cluster-token-file", default=None,
                       help="the cluster's shared secret (else env PDSERVE_CLUSTER_TOKEN): "
                            "workers without it cannot register")
    serve.add_argument("--internal-port", type=int, default=None,
                       help="serve the worker registry on its own port (needed with "
                            "--cluster-cert; default: on --port)")
    add_cluster_tls_args(serve)
    serve.add_argument("--grace-s", type=float, default=30.0,
                       help="on SIGTERM: seconds in-flight streams may take to finish")
    add_logging_args(serve)
    _add_placement_args(serve)


def _add_launch_args(launch: argparse.ArgumentParser) -> None:
    from security.tls import add_cluster_tls_args

    launch.add_argument("--prefill", type=int, default=1)
    launch.add_argument("--decode", type=int, default=1)
    launch.add_argument("--colocated", type=int, default=0,
                        help="run N colocated workers instead (the baseline)")
    launch.add_argument("--model", default="default")
    launch.add_argument("--host", default="127.0.0.1")
    launch.add_argument("--port", type=int, default=50051)
    launch.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    launch.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split each worker's model over N ranks, one process each (CPU, "
                             "gloo)")
    launch.add_argument("--prefill-tp", type=int, default=None,
                        help="prefill workers' ranks (default: --tensor-parallel-size)")
    launch.add_argument("--decode-tp", type=int, default=None,
                        help="decode workers' ranks (default: --tensor-parallel-size)")
    launch.add_argument("--dtype", default=None)
    launch.add_argument("--kv-cache-gb", type=float, default=None)
    launch.add_argument("--log-dir", type=Path, default=Path("logs"))
    launch.add_argument("--http-port", type=int, default=8000,
                        help="the router's OpenAI-compatible HTTP API port (0 turns it off)")
    _add_tls_args(launch, server=True)
    launch.add_argument("--tls-ca", default=None,
                        help="the CA of --tls-cert (the workers check the router with it)")
    launch.add_argument("--cluster-token-file", default=None,
                        help="the cluster's shared secret, given to every process (else env "
                             "PDSERVE_CLUSTER_TOKEN, which the processes inherit)")
    add_cluster_tls_args(launch)
    launch.add_argument("--secure", type=Path, default=None, metavar="DIR",
                        help="secure mode in one flag: TLS, mutual TLS and a cluster token from "
                             "the throwaway CA, certificate and token kept in DIR (written the "
                             "first time)")
    add_logging_args(launch)
    _add_gpu_args(launch)
    _add_placement_args(launch)


def _add_client_args(client: argparse.ArgumentParser) -> None:
    client.add_argument("prompt", nargs="?", default=None)
    client.add_argument("--chat", default=None, help="a user message (chat template applied)")
    client.add_argument("--address", default="127.0.0.1:50051")
    client.add_argument("--max-tokens", type=int, default=64)
    client.add_argument("--temperature", type=float, default=0.0)
    client.add_argument("--seed", type=int, default=None)
    client.add_argument("--timeout-s", type=float, default=120.0)
    client.add_argument("--tls-ca", default=None, help="the router's CA (a router with TLS)")


def _add_drain_args(drain: argparse.ArgumentParser) -> None:
    from security.tls import add_cluster_tls_args

    drain.add_argument("worker_id", help="as `GetClusterStatus` (or the launch log) names it")
    drain.add_argument("--undo", action="store_true", help="place requests on it again")
    drain.add_argument("--router", default="127.0.0.1:50051",
                       help="the router's address for workers (its --internal-port if it has "
                            "one, else its --port)")
    drain.add_argument("--cluster-token-file", default=None,
                       help="the cluster's shared secret (else env PDSERVE_CLUSTER_TOKEN)")
    drain.add_argument("--tls-ca", default=None, help="the router's CA (a router with TLS)")
    add_cluster_tls_args(drain)


def _add_certs_args(certs: argparse.ArgumentParser) -> None:
    certs.add_argument("--out", type=Path, required=True)
    certs.add_argument("--hosts", default="127.0.0.1,localhost",
                       help="names and addresses the router is reached at (comma-separated)")


def _add_tls_args(parser: argparse.ArgumentParser, server: bool) -> None:
    parser.add_argument("--tls-cert", default=None,
                        help="PEM certificate chain: the router's gRPC and HTTP ports use TLS")
    parser.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")


def _add_plan_args(plan: argparse.ArgumentParser) -> None:
    plan.add_argument("--workload", type=Path, required=True,
                      help="JSONL: prompt_token_ids (or prompt_tokens) and max_tokens per line")
    plan.add_argument("--slo", type=Path, required=True, help='JSON: {"ttft_s": .., "tpot_s": ..}')
    plan.add_argument("--workers", type=int, required=True, help="workers (cores, GPUs) to split")
    plan.add_argument("--rates", default="0.4", help="request rates (req/s), comma-separated")
    plan.add_argument("--profile", type=Path, default=None,
                      help="a worker's measured speed (python -m engine.profile --out FILE); "
                           "default: measure one now (default model, 1 thread)")
    plan.add_argument("--prefill-tp", type=int, default=1,
                      help="ranks per prefill worker (--workers then counts devices)")
    plan.add_argument("--decode-tp", type=int, default=1,
                      help="ranks per decode (and colocated) worker")
    plan.add_argument("--tp-profile", action="append", default=None, metavar="N=FILE",
                      help="a worker's speed at tensor-parallel size N (python -m "
                           "engine.profile --tensor-parallel-size N --out FILE); repeatable")
    plan.add_argument("--requests", type=int, default=400, help="simulated requests per run")
    plan.add_argument("--seeds", type=int, default=5, help="runs per rate (medians reported)")
    plan.add_argument("--max-tokens-cap", type=int, default=None,
                      help="cap each request's max_tokens (as the benchmark run did)")
    plan.add_argument("--json", type=Path, default=None, help="write every figure here too")


def _add_gpu_args(launch: argparse.ArgumentParser) -> None:
    launch.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: one GPU per worker, or round-robin when workers outnumber "
                             "the GPUs")
    launch.add_argument("--gpus", type=int, default=None,
                        help="cuda: GPUs to spread the workers over (default: every visible GPU)")
    launch.add_argument("--gpu-memory-fraction", type=float, default=None,
                        help="cuda: share of its GPU's memory each worker may use (default: "
                             "0.9 / workers on that GPU)")
    on = argparse.BooleanOptionalAction  # --x / --no-x; unset: the workers' default
    launch.add_argument("--cuda-graphs", action=on, default=None,
                        help="cuda: workers replay decode steps from CUDA graphs (default: on "
                             "for cuda)")
    launch.add_argument("--async-scheduling", action=on, default=None,
                        help="decode/colocated workers schedule step N+1 while step N runs "
                             "(default: on for cuda, off on cpu)")
    launch.add_argument("--fused-kernels", action=on, default=None,
                        help="cuda: fused Triton element-wise kernels in every worker (default: "
                             "on for cuda)")
    launch.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="tokens per engine step on every worker (default: the engine's, "
                             "512 on CPU)")
    launch.add_argument("--kv-transport", default="auto", choices=["auto", "shared", "dist"],
                        help="how KV moves from prefill to decode workers (auto: shared on one "
                             "host, else dist)")


def _add_placement_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--placement", default="cache-aware", choices=["cache-aware", "load"],
                        help="cache-aware: prefer workers whose prefix cache holds the prompt's "
                             "start, weighed against their queues; load: queues only")
    parser.add_argument("--local-prefill", default="auto", choices=["auto", "off"],
                        help="auto: a decode worker prefills short prompts (one of its "
                             "prefill chunks) and any prompt when the prefill workers are "
                             "backed up itself; off: prefill workers always do")
    parser.add_argument("--local-prefill-max-tokens", type=int, default=512,
                        help="auto: the prefill work (queued + this prompt) up to which a "
                             "decode worker prefills a prompt of one chunk locally")
    parser.add_argument("--queue-policy", default="short_first", choices=["fcfs", "short_first"],
                        help="which request queued in the router gets the next free slot "
                             "(short_first: fewest prompt tokens, within the age bound)")
    parser.add_argument("--queue-age-bound-s", type=float, default=4.0,
                        help="short_first: a request queued longer than this goes first")
    parser.add_argument("--rebalance-threshold", type=float, default=0.9,
                        help="a decode worker whose KV cache is this full (used / total blocks) "
                             "moves running requests' KV to workers with room instead of "
                             "preempting one by recompute (0: never)")
    parser.add_argument("--default-timeout-s", type=float, default=600.0,
                        help="the deadline of a request whose client set none (gRPC without a "
                             "deadline, HTTP without X-Request-Timeout)")


def placement_options(args: argparse.Namespace) -> dict[str, object]:
    """RouterOptions fields from the placement flags (ValueError on bad values)."""
    from router.policy.moves import RebalanceConfig
    from router.policy.prefill_site import PrefillSiteConfig

    return {"cache_aware": args.placement == "cache-aware",
            "rebalance": RebalanceConfig(args.rebalance_threshold),
            "local_prefill": PrefillSiteConfig(args.local_prefill,
                                               args.local_prefill_max_tokens),
            "queue_policy": args.queue_policy, "queue_age_bound_s": args.queue_age_bound_s,
            "default_timeout_s": args.default_timeout_s}


def placement_argv(args: argparse.Namespace) -> tuple[str, ...]:
    """The same flags, for the router process `launch` starts."""
    return ("--placement", args.placement, "--local-prefill", args.local_prefill,
            "--local-prefill-max-tokens", str(args.local_prefill_max_tokens),
            "--queue-policy", args.queue_policy, "--queue-age-bound-s",
            str(args.queue_age_bound_s), "--default-timeout-s", str(args.default_timeout_s),
            "--rebalance-threshold", str(args.rebalance_threshold))


def check_step_budget(budget: int | None, device: str) -> None:
    """A step budget every worker would refuse, refused before anything starts: each running
    request must be able to decode in every step."""
    from engine.config import SchedulerConfig

    seqs = SchedulerConfig.for_device(device).max_num_seqs
    if budget is not None and budget < seqs:
        raise ValueError(f"--max-num-batched-tokens must be >= the workers' max_num_seqs "
                         f"({seqs} on {device}) so every running request can decode each "
                         f"step, got {budget}")


def launch_spec(args: argparse.Namespace) -> ClusterSpec:
    """The cluster `launch` starts; on CUDA without --gpus, every visible GPU (found without
    torch: CUDA_VISIBLE_DEVICES, else `nvidia-smi -L`). Raises ValueError or GpuError."""
    from launch.cluster import ClusterSpec
    from launch.gpus import visible_gpus
    from security.secure_dir import FLAGS, check_no_credential_flags, secure_files

    colocated = args.colocated
    gpus = args.gpus
    if args.device == "cuda" and gpus is None:
        gpus = visible_gpus()
    check_step_budget(args.max_num_batched_tokens, args.device)
    credentials = {name: getattr(args, name) for name in FLAGS}
    if args.secure is not None:
        check_no_credential_flags(credentials)
        credentials = secure_files(args.secure, [args.host])
    return ClusterSpec(prefill=0 if colocated else args.prefill,
                       decode=0 if colocated else args.decode, colocated=colocated,
                       model=args.model, host=args.host, port=args.port,
                       threads=args.threads, dtype=args.dtype, kv_cache_gb=args.kv_cache_gb,
                       device=args.device, gpus=gpus,
                       gpu_memory_fraction=args.gpu_memory_fraction,
                       kv_transport=args.kv_transport, router_args=placement_argv(args),
                       cuda_graphs=args.cuda_graphs, async_scheduling=args.async_scheduling,
                       fused_kernels=args.fused_kernels,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       tensor_parallel_size=args.tensor_parallel_size,
                       prefill_tp=args.prefill_tp, decode_tp=args.decode_tp,
                       http_port=args.http_port, log_level=args.log_level,
                       log_format=args.log_format, **credentials)


def _serve(args: argparse.Namespace) -> int:
    from router.server import RouterOptions
    from router.server import serve as run_router
    from security.auth import load_token
    from security.tls import ClusterTls, ServerTls

    return run_router(RouterOptions(
        host=args.host, port=args.port, model=args.model,
        heartbeat_timeout_s=args.heartbeat_timeout_s, max_running=args.max_running,
        max_queued=args.max_queued, metrics_port=args.metrics_port, http_port=args.http_port,
        cluster_token=load_token(args.cluster_token_file),
        tls=ServerTls.load(args.tls_cert, args.tls_key), insecure=args.insecure,
        cluster_tls=ClusterTls.load(args.cluster_cert, args.cluster_key, args.cluster_ca),
        internal_port=args.internal_port, grace_s=args.grace_s, **placement_options(args)))


def _launch(args: argparse.Namespace) -> int:
    from launch.run import run_until_interrupted
    from router.server import RouterOptions
    from security.auth import load_token
    from security.tls import ClusterTls, ServerTls, read_ca

    load_token(args.cluster_token_file)  # bad files and values fail here, not in a child
    read_ca(args.tls_ca)
    ServerTls.load(args.tls_cert, args.tls_key)
    ClusterTls.load(args.cluster_cert, args.cluster_key, args.cluster_ca)
    if args.tls_cert and not args.tls_ca:
        raise ValueError("--tls-cert needs --tls-ca: the workers check the router with it "
                         "(python -m router certs writes both)")
    RouterOptions(**placement_options(args))
    return run_until_interrupted(launch_spec(args), args.log_dir)


def _certs(args: argparse.Namespace) -> int:
    from security.certs import make_certs

    paths = make_certs(args.out, [h for h in args.hosts.split(",") if h])
    print("\n".join(f"{name}: {path}" for name, path in paths.items()))
    return 0


def _client(args: argparse.Namespace) -> int:
    from common.client import build_request, stream
    from security.tls import read_ca

    if args.prompt is None and args.chat is None:
        raise ValueError("client needs a prompt or --chat")
    return stream(args.address, build_request(args.prompt, args.chat, args.max_tokens,
                                              args.temperature, args.seed), args.timeout_s,
                  read_ca(args.tls_ca))


def _drain(args: argparse.Namespace) -> int:
    """RouterAdmin.DrainWorker: the router stops placing on the worker and moves its running
    requests' KV to other decode workers (its move trigger does, within a fraction of a
    second)."""
    import grpc

    from common.grpc_server import internal_channel
    from pdserve_proto import pdserve_pb2 as pb
    from pdserve_proto import pdserve_pb2_grpc as pb_grpc
    from security import auth
    from security.tls import ClusterTls, read_ca

    auth.configure(auth.load_token(args.cluster_token_file),
                   ClusterTls.load(args.cluster_cert, args.cluster_key, args.cluster_ca))
    with internal_channel(args.router, read_ca(args.tls_ca)) as channel:
        try:
            reply = pb_grpc.RouterAdminStub(channel).DrainWorker(
                pb.DrainWorkerRequest(worker_id=args.worker_id, undo=args.undo), timeout=10.0)
        except grpc.RpcError as exc:
            print(f"drain {args.worker_id}: {exc.code().name}: {exc.details()}",
                  file=sys.stderr)
            return 1
    state = "draining: its running requests move to other decode workers" \
        if reply.draining else "taking requests"
    print(f"{reply.worker_id}: {state} ({reply.running_streams} streaming from it now)")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from planner.plan import run_plan

    return run_plan(args)


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    configure_logging(getattr(args, "log_level", "info"), getattr(args, "log_format", "text"))
    from launch.gpus import GpuError

    command = {"serve": _serve, "launch": _launch, "certs": _certs, "plan": _plan,
               "client": _client, "drain": _drain}[args.command]
    try:
        return command(args)
    except (ValueError, GpuError) as exc:  # bad flags or files: a usage error
        parser.error(str(exc))
    except OSError as exc:
        if args.command not in ("plan", "certs"):
            raise
        parser.error(str(exc))


if __name__ == "__main__":
    sys.exit(main())

"""python -m deploy {up,status,down} --config deploy/pdserve.yaml [--ray-address ADDR]

  up      start the router and the workers on the running Ray cluster; wait until they serve
  status  nodes, actors (role, node, endpoint, restarted), the router's registered workers
          and the autoscaler's last decisions with their inputs
  down    drain and stop every actor of the deployment, remove its placement group
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from deploy.config import NODE_IP, ConfigError, DeployConfig
from deploy.security import with_secure_dir


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["up", "status", "down"])
    parser.add_argument("--config", type=Path, default=Path(__file__).with_name("pdserve.yaml"))
    parser.add_argument("--ray-address", default=None,
                        help="overrides ray.address in the config (e.g. auto, HOST:6379)")
    parser.add_argument("--json", action="store_true", help="status as JSON")
    parser.add_argument("--secure", type=Path, default=None, metavar="DIR",
                        help="secure mode in one flag (up and status): a throwaway CA, "
                             "certificate and cluster token kept in DIR (written the first "
                             "time) for TLS, mutual TLS and the token; one node, or a DIR "
                             "every node sees")
    return parser


def load_config(path: Path, ray_address: str | None, secure: Path | None = None
                ) -> DeployConfig:
    config = DeployConfig.from_yaml(path)
    if ray_address:
        config = dataclasses.replace(config, ray=dataclasses.replace(config.ray,
                                                                     address=ray_address))
    if secure is not None:
        node_ip = None
        if NODE_IP in (config.router.host, config.workers.host):
            from ray.util import get_node_ip_address  # the address Ray gives this node

            node_ip = get_node_ip_address()
        config = with_secure_dir(config, secure, node_ip)
    return config


def render_status(report: dict[str, Any]) -> str:
    lines = [f"deployment {report['name']}", "nodes:"]
    for node in report["nodes"]:
        resources = ", ".join(f"{k} {v:g}" for k, v in sorted(node["resources"].items())
                              if not k.startswith(("node:", "memory", "object_store")))
        lines.append(f"  {node['node_id'][:12]} {node['ip']:15} "
                     f"{'alive' if node['alive'] else 'DEAD':5} {resources}")
    lines.append("actors:")
    for actor in report["actors"]:
        if actor["state"] != "alive":
            lines.append(f"  {actor['name']:24} {actor['state']}")
            continue
        lines.append(f"  {actor['name']:24} alive  {actor['address']:21} node "
                     f"{actor['node_id'][:12]} pid {actor['pid']}"
                     f"{'  (restarted)' if actor['restarted'] else ''}")
    lines.append("registered with the router:")
    for worker in report["registered"] or [{"error": "none"}]:
        if "error" in worker:
            lines.append(f"  {worker['error']}")
            continue
        state = "draining" if worker["draining"] else "healthy" if worker["healthy"] else \
            "unhealthy"
        lines.append(f"  {worker['id']:12} {worker['role']:20} {worker['address']:21} {state}")
    lines += _render_autoscaler(report.get("autoscaler"))
    return "\n".join(lines)


def _render_autoscaler(scaler: dict[str, Any] | None) -> list[str]:
    if scaler is None:
        return []
    mode = " (dry run: nothing is changed)" if scaler.get("dry_run") else ""
    lines = [f"autoscaler: {scaler['state']}{mode}; last decisions:"]
    for d in scaler["decisions"] or [{"error": "none yet"}]:
        when = time.strftime("%H:%M:%S", time.localtime(d["time"])) if "time" in d else ""
        if "error" in d:
            lines.append(f"  {when} {d['error']}")
            continue
        flip = f", local prefill -> {d['local_prefill']}" if d.get("local_prefill") else ""
        target = f" {d['role']} {d.get('worker_id', '')}".rstrip() if d["role"] else ""
        lines.append(f"  {when} {d['action']}{target}{flip}: {d['reason']}  inputs "
                     f"{json.dumps(d['inputs'], sort_keys=True)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config, args.ray_address, args.secure)
    except ConfigError as exc:
        print(f"invalid deployment config {args.config}: {exc}", file=sys.stderr)
        return 2
    from deploy import deployment  # imports ray: only once the config is known to be valid

    try:
        if args.command == "up":
            result = deployment.deploy(config)
            print(f"deployment {result.name} serving on {result.router_address}")
            for actor in result.actors:
                print(f"  {actor['id']:12} {actor['address']:21} node {actor['node_ip']}")
            ca = f" --tls-ca {config.tls.ca_file}" if config.tls.enabled else ""
            print(f"try: python -m router client --address {result.router_address}{ca} "
                  "\"Hello!\"")
        elif args.command == "status":
            report = deployment.status(config)
            print(json.dumps(report, indent=1) if args.json else render_status(report))
        else:
            names = deployment.teardown(config)
            print(f"stopped {len(names)} actors: {', '.join(names) or 'none running'}")
    except (ConfigError, deployment.DeployError) as exc:
        print(f"{args.command} failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

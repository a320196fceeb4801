"""`python -m router launch`: start the whole cluster on this machine (launch.cluster), print how
to reach it, and run until Ctrl-C or a process exits."""

from __future__ import annotations

import signal
import time
from pathlib import Path

from launch.cluster import ClusterSpec, LocalCluster


def run_until_interrupted(spec: ClusterSpec, log_dir: Path | None) -> int:
    cluster = LocalCluster(spec, log_dir)
    print("starting the cluster (loading the model in every worker)...", flush=True)
    # During start a signal interrupts it at once (start() stops what it had started): a flag
    # read only once the workers were up let a SIGTERM wait minutes, and a supervisor's SIGKILL
    # after its grace period then orphaned every process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _interrupt)
    try:
        cluster.start()
    except KeyboardInterrupt:
        print("interrupted during start: stopped", flush=True)
        return 130
    stop = {"now": False}
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.update(now=True))
    try:
        _say_ready(cluster, spec)
        while not stop["now"]:
            dead = [n for n, p in cluster.processes.items() if p.poll() is not None]
            if dead:
                print(f"processes exited: {dead}; stopping the cluster", flush=True)
                return 1
            time.sleep(0.5)
    finally:
        print("stopping...", flush=True)
        cluster.stop()
    return 0


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(signal.Signals(signum).name)


def _say_ready(cluster: LocalCluster, spec: ClusterSpec) -> None:
    http = cluster.status().http_address
    ca = f" --tls-ca {spec.tls_ca}" if spec.tls_cert else ""
    print(f"cluster ready: {cluster.address}  "
          f"({spec.prefill} prefill + {spec.decode} decode, {spec.colocated} colocated"
          f"{_gpu_note(cluster)})\n"
          f"try: pdserve client --address {cluster.address}{ca} \"Hello!\"\n"
          + (f"OpenAI-compatible API: http{'s' if ca else ''}://{http}/v1\n" if http else "")
          + "Ctrl-C stops everything.", flush=True)


def _gpu_note(cluster: LocalCluster) -> str:
    if not cluster.gpu_slots:
        return ""
    placed = ", ".join(f"{name} on cuda:{slot.index} ({slot.memory_fraction:g})"
                       for name, slot in cluster.gpu_slots.items())
    return f"; {placed}"

"""Which transport moves KV between a prefill worker and a decode worker, from where the two are.

Plain Python over strings (the router uses it too, and imports no torch):
- same host (CPU or GPU, one GPU or two): "shared" — the prefill worker maps the decode worker's
  exported cache once and copies each request's blocks straight into the reserved block ids;
- different hosts: "dist" — a torch.distributed pair group (gloo for CPU, NCCL for CUDA tensors).
A worker's `--kv-transport` may force one of them; a pair that can never work is refused with the
reason, naming both workers, before anything is sent.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

TRANSPORTS = ("shared", "dist")
MODES = ("auto", *TRANSPORTS)


class TransportRefused(ValueError):
    """This (prefill, decode) pair cannot move KV with the transports its workers allow."""


@dataclass(frozen=True)
class KVPlace:
    """Where a worker's KV cache lives, as its registration tells the router."""

    worker_id: str
    host_id: str
    device: str  # "cpu" or "cuda:<GPU UUID>"
    mode: str = "auto"  # the worker's --kv-transport

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"kv_transport must be one of {', '.join(MODES)}, got {self.mode!r}")

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")


def choose_transport(sender: KVPlace, receiver: KVPlace,
                     unusable: Mapping[str, str] | None = None) -> str:
    """"shared" or "dist" for KV going from `sender` (prefill) to `receiver` (decode); raises
    TransportRefused when none can work for this pair. `unusable`: transports that failed for
    this pair in a way that would repeat (-> why); an automatic choice falls back past them (a
    same-host pair whose cache cannot be mapped, e.g. across network namespaces, uses dist)."""
    pair = f"{sender.worker_id} -> {receiver.worker_id}"
    forced = {p.mode for p in (sender, receiver)} - {"auto"}
    if len(forced) > 1:
        raise TransportRefused(f"{pair}: {sender.worker_id} forces --kv-transport {sender.mode} "
                               f"but {receiver.worker_id} forces {receiver.mode}")
    same_host = bool(sender.host_id) and sender.host_id == receiver.host_id
    candidates = [forced.pop()] if forced else ["shared", "dist"] if same_host else ["dist"]
    reasons = []
    for transport in candidates:
        reason = (unusable or {}).get(transport) or _refusal(transport, pair, sender, receiver,
                                                             same_host)
        if reason is None:
            return transport
        reasons.append(reason)
    raise TransportRefused("; and ".join(reasons))


def _refusal(transport: str, pair: str, sender: KVPlace, receiver: KVPlace,
             same_host: bool) -> str | None:
    if transport == "shared" and not same_host:
        return (f"{pair}: the shared transport needs both workers on one host, but they are on "
                f"{sender.host_id!r} and {receiver.host_id!r}")
    if transport == "dist" and sender.on_gpu != receiver.on_gpu:
        return (f"{pair}: the dist transport sends CPU tensors over gloo and CUDA tensors over "
                f"NCCL, but the workers' caches are on {sender.device} and {receiver.device}")
    if transport == "dist" and sender.on_gpu and same_host and sender.device == receiver.device:
        return (f"{pair}: both workers are on GPU {sender.device}, and NCCL cannot put two "
                f"ranks on one GPU; use --kv-transport shared or auto")
    return None


def local_host_id() -> str:
    """A stable identity of this host: the kernel's boot id (shared by every process of one
    running machine, new after a reboot) with the host name; PDSERVE_HOST_ID overrides it."""
    override = os.environ.get("PDSERVE_HOST_ID")
    if override:
        return override
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "no-boot-id"
    return f"{socket.gethostname()}/{boot}"

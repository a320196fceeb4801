"""Network namespaces for partition tests: one namespace per process and a veth link per pair of
namespaces that talk. Each namespace's address is a /32 on its own loopback, reached through the
pair's link by a host route, so cutting one link (both ends down) silences exactly that pair:
established TCP connections go quiet as in a real partition (no reset, no error) and new ones are
unreachable; healing brings the link and its routes back. Everything is created and removed by
the test; nothing touches the host's own interfaces. Needs root and iproute2: `unavailable()`
says why not."""

from __future__ import annotations

import ctypes
import functools
import itertools
import os
import shutil
import subprocess
from pathlib import Path

COMMAND_TIMEOUT_S = 10.0
CLONE_NEWNET = 0x40000000
NETNS_DIR = Path("/var/run/netns")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=COMMAND_TIMEOUT_S)


@functools.cache
def unavailable() -> str | None:
    """Why namespaces cannot be used here, or None when they can (tried once)."""
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root"
    probe = f"pdsprobe{os.getpid()}"
    # the whole pid in the link's name (at most 15 characters): both xdist workers probe at
    # collection, and a name cut to the pid's first digits once made one of them refused
    # ("File exists") and skip every partition test
    veth = f"pp{os.getpid()}"
    try:
        _ip("netns", "add", probe)
        _ip("link", "add", f"{veth}a", "type", "veth", "peer", "name", f"{veth}b")
        _ip("link", "del", f"{veth}a")
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        stderr = getattr(exc, "stderr", b"") or b""
        return f"`ip netns`/veth refused here: {stderr.decode(errors='replace').strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True,
                       timeout=COMMAND_TIMEOUT_S)
    return None


def enter(namespace: str) -> None:
    """Move the calling thread (in a fresh process: the process) into `namespace`."""
    libc = ctypes.CDLL(None, use_errno=True)
    with open(NETNS_DIR / namespace) as handle:
        if libc.setns(handle.fileno(), CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), f"setns into {namespace} failed")


class Partitions:
    """Namespaces named `nodes` (e.g. router, prefill-0) with a link for each pair in `links`."""

    def __init__(self, nodes: list[str], links: list[tuple[str, str]], subnet: str = "10.213.0"):
        self.tag = f"pd{os.getpid() % 100000}"
        self.nodes = list(nodes)
        self.links = [tuple(sorted(pair)) for pair in links]
        self.addresses = {node: f"{subnet}.{i + 1}" for i, node in enumerate(self.nodes)}
        self._veths = {pair: (f"{self.tag}l{i}a", f"{self.tag}l{i}b")
                       for i, pair in enumerate(self.links)}

    def namespace(self, node: str) -> str:
        return f"{self.tag}-{node}"

    def exec_prefix(self, node: str) -> list[str]:
        """Run a command in `node`'s namespace: prefix its argv with this."""
        return ["ip", "netns", "exec", self.namespace(node)]

    def create(self) -> Partitions:
        try:
            for node in self.nodes:
                _ip("netns", "add", self.namespace(node))
                _ip("-n", self.namespace(node), "link", "set", "lo", "up")
                _ip("-n", self.namespace(node), "addr", "add", f"{self.addresses[node]}/32",
                    "dev", "lo")
            for (a, b), (end_a, end_b) in self._veths.items():
                _ip("link", "add", end_a, "type", "veth", "peer", "name", end_b)
                _ip("link", "set", end_a, "netns", self.namespace(a))
                _ip("link", "set", end_b, "netns", self.namespace(b))
                self.heal(a, b)
        except BaseException:
            self.destroy()
            raise
        return self

    def _ends(self, a: str, b: str) -> list[tuple[str, str, str]]:
        """(node, its veth end, the peer) for both ends of the a–b link."""
        pair = tuple(sorted((a, b)))
        end_a, end_b = self._veths[pair]
        return [(pair[0], end_a, pair[1]), (pair[1], end_b, pair[0])]

    def cut(self, a: str, b: str) -> None:
        """Silence the a–b link: both ends down (their routes go with them)."""
        for node, end, _ in self._ends(a, b):
            _ip("-n", self.namespace(node), "link", "set", end, "down")

    def heal(self, a: str, b: str) -> None:
        """Bring the a–b link up and route each end's address through it."""
        for node, end, _ in self._ends(a, b):
            _ip("-n", self.namespace(node), "link", "set", end, "up")
        for node, end, peer in self._ends(a, b):
            _ip("-n", self.namespace(node), "route", "replace", f"{self.addresses[peer]}/32",
                "dev", end, "src", self.addresses[node])

    def cut_all(self, group_a: list[str], group_b: list[str]) -> list[tuple[str, str]]:
        """Cut every link between the two groups; the pairs cut."""
        pairs = [p for p in itertools.product(group_a, group_b) if tuple(sorted(p)) in self.links]
        for a, b in pairs:
            self.cut(a, b)
        return pairs

    def destroy(self) -> None:
        """Remove the namespaces (their veth ends go with them). Best effort, never raises."""
        for node in self.nodes:
            subprocess.run(["ip", "netns", "del", self.namespace(node)], capture_output=True,
                           timeout=COMMAND_TIMEOUT_S)
        for end_a, _ in self._veths.values():  # a link never moved into a namespace
            subprocess.run(["ip", "link", "del", end_a], capture_output=True,
                           timeout=COMMAND_TIMEOUT_S)

    def __enter__(self) -> Partitions:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.destroy()

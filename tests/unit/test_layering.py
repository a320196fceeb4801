"""The layering rules of ARCHITECTURE.md, checked on the source: which package may import which,
that the router and the bookkeeping stay torch-free, that only deploy/ imports ray, that nothing
outside router/ reaches into the router's internals, and that the workers reach KV transports
only through the connector interface."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What each package may import of the project (besides itself and the generated pdserve_proto).
ALLOWED = {
    "engine": set(),
    "security": set(),
    "kv_transfer": {"engine", "common"},
    "common": {"engine", "security"},
    "serving": {"engine", "kv_transfer", "common", "security"},
    "prefill_worker": {"engine", "kv_transfer", "common", "serving"},
    "decode_worker": {"engine", "kv_transfer", "common", "serving"},
    "router": {"engine", "kv_transfer", "common", "security"},
    "planner": {"router"},
    "launch": {"common", "security"},
    "cli": {"router", "launch", "planner", "common", "security", "serving", "engine"},
    # engine: a tensor-parallel rank's body (engine.tp_ranks.rank_main), run in a rank actor
    "deploy": {"router", "prefill_worker", "decode_worker", "serving", "common", "security",
               "engine", "planner", "loadtest"},
    "loadtest": {"engine", "launch", "common"},
}
PROJECT_PACKAGES = set(ALLOWED) | {"benchmarks", "pdserve_proto"}
# The router's public surface: the process (server) and its pure policies (the planner simulates
# them). Everything else under router/ is internal.
ROUTER_PUBLIC = ("router.server", "router.policy")


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def imports_of(path: Path) -> set[str]:
    return {name.split(".")[0] for name in imported_modules(path)}


def py_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_each_package_imports_only_the_layers_below_it():
    for package, allowed in ALLOWED.items():
        for f in py_files(package):
            if f == ROOT / "router" / "__main__.py":
                continue  # `python -m router launch ...` kept working: it calls cli.cluster
            bad = imports_of(f) & PROJECT_PACKAGES - allowed - {package, "pdserve_proto"}
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_engine_imports_neither_grpc_nor_ray():
    for f in py_files("engine"):
        assert not imports_of(f) & {"grpc", "ray"}, f


def test_bookkeeping_modules_import_no_torch():
    for name in ("request", "block_manager", "scheduler", "queue_order", "prefix_wait", "forks",
                 "config", "architectures", "tokenizer"):
        assert "torch" not in imports_of(ROOT / "engine" / f"{name}.py"), name


def test_router_imports_no_torch_and_only_deploy_imports_ray():
    for f in py_files("router"):
        assert "torch" not in imports_of(f), f
    for package in PROJECT_PACKAGES - {"deploy"}:
        for f in py_files(package):
            assert "ray" not in imports_of(f), f


def test_nothing_outside_the_router_reaches_into_it():
    for package in sorted(PROJECT_PACKAGES - {"router"}):
        for f in py_files(package):
            inside = {m for m in imported_modules(f) if m.split(".")[0] == "router"}
            bad = {m for m in inside if not m.startswith(ROUTER_PUBLIC)}
            assert not bad, f"{f.relative_to(ROOT)} imports router internals {bad}"


# What a worker may use of kv_transfer: the connector interface, the builder of its connectors,
# and the transport-neutral pieces; never a transport's own subpackage.
CONNECTOR_SURFACE = {"kv_transfer", "kv_transfer.connector", "kv_transfer.connectors",
                     "kv_transfer.errors", "kv_transfer.selection", "kv_transfer.device"}
WORKER_PACKAGES = ("prefill_worker", "decode_worker", "serving")


def test_workers_import_no_transport_by_name():
    from kv_transfer.selection import TRANSPORTS

    for package in WORKER_PACKAGES:
        for f in py_files(package):
            used = {m for m in imported_modules(f) if m.split(".")[0] == "kv_transfer"}
            bad = used - CONNECTOR_SURFACE
            assert not bad, f"{f.relative_to(ROOT)} imports {bad}"
            names = {node.value for node in ast.walk(ast.parse(f.read_text()))
                     if isinstance(node, ast.Constant) and isinstance(node.value, str)}
            assert not names & set(TRANSPORTS), f"{f.relative_to(ROOT)} names a transport"


def test_each_transport_lives_in_its_own_subpackage():
    """Only the connector builder names the transports' subpackages, and neither transport
    imports the other."""
    from kv_transfer.selection import TRANSPORTS

    for f in py_files("kv_transfer"):
        inside = {m.split(".")[1] for m in imported_modules(f)
                  if m.startswith("kv_transfer.") and m.split(".")[1] in TRANSPORTS}
        home = f.relative_to(ROOT / "kv_transfer").parts[0]
        if f.name == "connectors.py":
            continue
        assert inside <= {home}, f"{f.relative_to(ROOT)} imports transports {inside - {home}}"

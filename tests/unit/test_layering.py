"""The layering rules of ARCHITECTURE.md, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = {"engine", "router", "prefill_worker", "decode_worker", "kv_transfer", "deploy",
                    "serving"}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def py_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_engine_imports_no_other_project_package_nor_grpc_or_ray():
    for f in py_files("engine"):
        bad = imports_of(f) & (PROJECT_PACKAGES - {"engine"} | {"grpc", "ray"})
        assert not bad, f"{f} imports {bad}"


def test_bookkeeping_modules_import_no_torch():
    for name in ("request", "block_manager", "scheduler", "queue_order", "config", "tokenizer"):
        assert "torch" not in imports_of(ROOT / "engine" / f"{name}.py"), name


def test_router_imports_no_torch_and_only_deploy_imports_ray():
    for f in py_files("router"):
        assert "torch" not in imports_of(f), f
    for package in PROJECT_PACKAGES - {"deploy"}:
        for f in py_files(package):
            assert "ray" not in imports_of(f), f

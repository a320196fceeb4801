"""engine.native_kernels lists every native kernel: a kernel module added later without its
switch there would be built by engine starts rather than by `build-kernels`, and a benchmark's
fresh worktree would compile it."""

from __future__ import annotations

import re
from pathlib import Path

from engine.native_kernels import ALL_SWITCHES, FORWARD_SWITCHES

ENGINE = Path(__file__).resolve().parents[2] / "engine"
SWITCH = re.compile(r'^\w*DISABLE_ENV = "(PDSERVE_DISABLE_\w+)"$', re.MULTILINE)
BUILDS = re.compile(r"\btry_build_native\(|\bbuild_native\(")


def _kernel_modules() -> list[Path]:
    return [p for p in ENGINE.rglob("*.py")
            if p.name != "native_build.py" and BUILDS.search(p.read_text())]


def test_every_module_that_builds_a_kernel_has_a_switch():
    modules = _kernel_modules()
    assert len(modules) >= 5
    for module in modules:
        assert SWITCH.search(module.read_text()), f"{module} builds a kernel with no off switch"


def test_every_switch_in_the_engine_is_listed_once():
    declared = [name for p in _kernel_modules() for name in SWITCH.findall(p.read_text())]
    assert sorted(declared) == sorted(ALL_SWITCHES)
    assert len(set(ALL_SWITCHES)) == len(ALL_SWITCHES)


def test_the_forward_kernels_are_all_but_the_samplers():
    assert set(ALL_SWITCHES) - set(FORWARD_SWITCHES) == {"PDSERVE_DISABLE_NATIVE_ARGMAX"}

"""Counts the JIT compilations that happen inside a `with` block: Triton kernels compiled (the
runtime's cache-miss hook, called before every compilation of a kernel variant not yet in
memory) and torch.compile graphs built (dynamo's counter)."""

from __future__ import annotations

from typing import Any


class JitCounter:
    def __init__(self) -> None:
        self.triton_compiles: list[str] = []
        self.torch_graphs = 0
        self._previous_hook: Any = None
        self._graphs_before = 0

    def __enter__(self) -> JitCounter:
        from triton import knobs

        self._previous_hook = knobs.runtime.jit_cache_hook
        knobs.runtime.jit_cache_hook = self._hook
        self._graphs_before = _dynamo_graphs()
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_cache_hook = self._previous_hook
        self.torch_graphs = _dynamo_graphs() - self._graphs_before

    def _hook(self, *args: Any, **kwargs: Any) -> bool:
        # the kernel's name and its specialization key: which argument values were new
        name = getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("repr") or args[:1])
        self.triton_compiles.append(f"{name} {kwargs.get('key')}")
        return False  # compile as usual: only count


def _dynamo_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0
    return int(counters["stats"].get("unique_graphs", 0))

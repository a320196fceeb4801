"""Every native build the suite uses, and a background prebuild of them at session start.

The native modules take 15-30 s each to compile on 2 cores (a minute or so each while they
included <torch/extension.h>), and the kernel tests build more variants of them (what machines
without AVX-512 or AVX2 compile). Built one after another, in whichever test first needs each,
the suite once waited ~4 minutes on g++ running on one core while the other idled. `conftest.py`
starts this module as two background processes when the session starts — the attention
builds in one, the element-wise ones and the few-row GEMMs in the other — and whichever test
needs a module first waits for that build through torch's own lock on the build directory (a
build in progress is never started twice), then loads it from the cache.

Run as `python -m tests.native_builds decode|elementwise`.
"""

from __future__ import annotations

import signal
import sys
from types import ModuleType

from engine.attention.cpu_kernel import NO_AMX_CFLAGS
from engine.native_build import build_native, cpu_flags

# The decode kernel's variants: flag -> the CPU feature it takes away. Where the machine lacks
# that feature its own build already is that path, and the variant is neither built nor tested.
DECODE_VARIANTS = {"-mno-avx512f": "avx512f", "-mno-avx512bf16": "avx512_bf16",
                   "-mno-avx2": "avx2"}
# The element-wise module built as an AVX2 machine builds it (tested where the machine's own
# build is AVX-512), and as a machine with no vector units builds it (nothing runs: -O0 will do).
ELEMENTWISE_AVX2 = ("-mno-avx512f",)
# Its AVX-512 build without AVX512-BF16: bf16 rounded in integer operations, not vcvtneps2bf16.
ELEMENTWISE_NO_BF16 = ("-mno-avx512bf16",)
ELEMENTWISE_PORTABLE = ("-mno-avx2", "-O0")


def has(feature: str) -> bool:
    return feature in cpu_flags().split()


def decode_variant(flag: str) -> ModuleType:
    from engine.attention.cpu_kernel import build_kernel

    return build_kernel(extra_cflags=(flag,))


def elementwise_variant(*extra: str) -> ModuleType:
    from engine.models.cpu_elementwise import CFLAGS, PREFIX, SOURCE

    return build_native(PREFIX, SOURCE, (*CFLAGS, *extra))


def prefill_variant(*flags: str) -> ModuleType:
    from engine.attention.cpu_kernel import build_prefill_kernel

    return build_prefill_kernel(extra_cflags=flags)


def _decode_builds() -> None:
    """The attention kernels: decode, then the causal prefill kernel and its builds for
    machines without AMX, without AVX512-BF16 and without AVX-512."""
    from engine.attention.cpu_kernel import load_cpu_kernel, load_prefill_kernel

    load_cpu_kernel()
    for flag, feature in DECODE_VARIANTS.items():
        if has(feature):
            decode_variant(flag)
    load_prefill_kernel()
    if has("amx_bf16"):
        prefill_variant(*NO_AMX_CFLAGS)
    if has("avx512_bf16"):
        prefill_variant("-mno-avx512bf16")
    if has("avx512f"):
        prefill_variant("-mno-avx512f")


def _elementwise_builds() -> None:
    from engine.models.cpu_elementwise import load_cpu_elementwise
    from engine.row_argmax import load_native_argmax

    load_cpu_elementwise()
    load_native_argmax()
    if has("avx512f"):
        elementwise_variant(*ELEMENTWISE_AVX2)
    if has("avx512_bf16"):
        elementwise_variant(*ELEMENTWISE_NO_BF16)
    elementwise_variant(*ELEMENTWISE_PORTABLE)
    if has("avx2") and has("fma"):  # the few-row GEMM (its tests build it on any such CPU)
        from engine.models.cpu_small_gemm import build_small_gemm

        build_small_gemm()
    if has("amx_bf16"):  # the AMX GEMM
        from engine.models.amx_gemm import load_amx_gemm

        load_amx_gemm()


def _stop_on_sigterm(signum: int, frame: object) -> None:
    # Unwinding (not dying on the signal) lets torch release its lock on the build directory, so
    # an interrupted prebuild never leaves a lock that later builds would wait on forever.
    raise SystemExit(1)


def main(which: str) -> int:
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    builds = {"decode": _decode_builds, "elementwise": _elementwise_builds}
    try:
        builds[which]()
    except Exception as exc:  # the test that needs the build reports the failure itself
        print(f"prebuild of the {which} kernels failed: {exc}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

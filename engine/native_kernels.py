"""Every native CPU kernel a CPU engine may load: each one's off switch, and the one call that
builds (or finds cached) those that apply on this machine, so that no engine start compiles one.

Each kernel's module owns its build, its switch and the rule for where it applies; this is the
list of them, so that the callers that need all of them (`python -m engine build-kernels`, a
benchmark running a fresh worktree) cannot miss one added later.
"""

from __future__ import annotations

from types import ModuleType

from engine import row_argmax
from engine.attention import cpu_kernel
from engine.models import amx_gemm, cpu_elementwise, cpu_small_gemm
from engine.native_build import cpu_flags, cpu_has_amx_bf16

# The kernels inside the model's forward: a forward replaced by a stub never loads them.
FORWARD_SWITCHES = (cpu_kernel.DISABLE_ENV, cpu_kernel.PREFILL_DISABLE_ENV,
                    cpu_elementwise.DISABLE_ENV, cpu_small_gemm.DISABLE_ENV,
                    amx_gemm.DISABLE_ENV)
# Every native kernel's switch: the forward's and the sampler's argmax.
ALL_SWITCHES = (*FORWARD_SWITCHES, row_argmax.DISABLE_ENV)


def build_all() -> dict[str, ModuleType | None]:
    """Each kernel that applies on this machine, by what it computes: its loaded module, or
    None where it could not be built (its torch path then serves)."""
    kernels = {"decode attention": cpu_kernel.load_cpu_kernel(),
               "element-wise": cpu_elementwise.load_cpu_elementwise()}
    if kernels["decode attention"] is not None and cpu_kernel.prefill_kernel_applies():
        kernels["prefill attention"] = cpu_kernel.load_prefill_kernel()  # else SDPA
    if cpu_small_gemm.measured_machine():  # elsewhere oneDNN serves every linear
        kernels["few-row GEMM"] = cpu_small_gemm.load_cpu_small_gemm()
    if cpu_has_amx_bf16():  # bfloat16 steps of few rows on the tiles
        kernels["AMX GEMM"] = amx_gemm.load_amx_gemm()
    if "avx512f" in cpu_flags().split():  # elsewhere torch's argmax forms serve
        kernels["row argmax"] = row_argmax.load_native_argmax()
    return kernels

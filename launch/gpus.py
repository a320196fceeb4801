"""Which GPU each locally launched worker gets, and how much of it (no torch: the launcher must run
on a machine whose router process never touches CUDA).

Workers are spread round-robin over the GPUs, so with at least as many GPUs as workers each has
its own GPU; with fewer, several share one. A worker may use `DEFAULT_FRACTION` of its GPU's
memory divided by the number of workers on that GPU (rounded down to 2 decimals), or an explicit
fraction; the workers on one GPU never ask for more than `MAX_FRACTION_PER_GPU` of it together.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

DEFAULT_FRACTION = 0.9  # of a GPU's total memory, for all the workers on it together
MAX_FRACTION_PER_GPU = 0.95  # what the workers on one GPU may ask for together, at most


class GpuError(RuntimeError):
    """No GPU can be found for `--device cuda`."""


@dataclass(frozen=True)
class GpuSlot:
    """One worker's GPU: `cuda:<index>` (an index among the visible GPUs) and the fraction of its
    memory the worker's engine may use."""

    index: int
    memory_fraction: float

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"GPU index must be >= 0, got {self.index}")
        if not 0 < self.memory_fraction <= MAX_FRACTION_PER_GPU:
            raise ValueError(f"--gpu-memory-fraction must be in (0, {MAX_FRACTION_PER_GPU}], "
                             f"got {self.memory_fraction}")

    @property
    def worker_args(self) -> list[str]:
        return ["--device", f"cuda:{self.index}",
                "--gpu-memory-fraction", f"{self.memory_fraction:g}"]


def share_of(workers_on_gpu: int, total: float = DEFAULT_FRACTION) -> float:
    """`total` split evenly over the workers on one GPU, rounded down to 2 decimals."""
    if workers_on_gpu < 1:
        raise ValueError(f"workers on a GPU must be >= 1, got {workers_on_gpu}")
    # round() first so 0.9 / 3 = 0.30000000000000004 is 0.30, not 0.29 after the floor
    return math.floor(round(total / workers_on_gpu * 100, 6)) / 100


def planned_per_gpu(num_workers: int, num_gpus: int) -> list[int]:
    """How many of `num_workers` workers, spread round-robin, land on each of `num_gpus` GPUs."""
    if num_gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {num_gpus}")
    return [len(range(gpu, num_workers, num_gpus)) for gpu in range(num_gpus)]


def place_worker(existing: Sequence[GpuSlot], planned_workers: int, num_gpus: int,
                 fraction: float | None = None) -> GpuSlot:
    """The GPU for one more worker, given the slots of the workers alive now: the GPU with the
    fewest workers (the lowest index on a tie, which makes a fresh start round-robin). Its memory
    share is `fraction` if given, else the default share for as many workers as that GPU will
    hold — at least as many as the plan of `planned_workers` puts there, so the first workers
    already leave room for the later ones. Raises ValueError when the GPU has no room left."""
    counts = [0] * num_gpus
    held = [0.0] * num_gpus
    for slot in existing:
        if slot.index >= num_gpus:
            raise ValueError(f"a worker holds cuda:{slot.index} but --gpus is {num_gpus}")
        counts[slot.index] += 1
        held[slot.index] += slot.memory_fraction
    index = min(range(num_gpus), key=lambda gpu: (counts[gpu], gpu))
    sharing = max(planned_per_gpu(planned_workers, num_gpus)[index], counts[index] + 1)
    share = fraction if fraction is not None else share_of(sharing)
    if share <= 0 or held[index] + share > MAX_FRACTION_PER_GPU + 1e-9:
        raise ValueError(
            f"GPU cuda:{index} has no room for another worker: its {counts[index]} worker(s) "
            f"hold {held[index]:.2f} of its memory and one more needs {share:.2f} "
            f"(--gpu-memory-fraction; the workers on one GPU may use {MAX_FRACTION_PER_GPU} "
            f"together, {sharing} workers would share it)")
    return GpuSlot(index, share)


def assign_gpus(num_workers: int, num_gpus: int, fraction: float | None = None
                ) -> list[GpuSlot]:
    """The slots of `num_workers` workers started together on `num_gpus` GPUs, in start order."""
    slots: list[GpuSlot] = []
    for _ in range(num_workers):
        slots.append(place_worker(slots, num_workers, num_gpus, fraction))
    return slots


def visible_gpus(env: Mapping[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] = subprocess.run) -> int:
    """How many GPUs this process's children can use: the entries of CUDA_VISIBLE_DEVICES when it
    is set, else the GPUs `nvidia-smi -L` lists. Raises GpuError when there are none."""
    env = os.environ if env is None else env
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = _count_visible(visible)
        if count == 0:
            raise GpuError(f"no GPU found: CUDA_VISIBLE_DEVICES is {visible!r}")
        return count
    try:
        listed = run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise GpuError(f"no GPU found: CUDA_VISIBLE_DEVICES is not set and `nvidia-smi -L` "
                       f"could not run ({exc})") from exc
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    if listed.returncode != 0 or count == 0:
        detail = (listed.stderr or listed.stdout).strip() or f"exit status {listed.returncode}"
        raise GpuError(f"no GPU found: `nvidia-smi -L` lists none ({detail})")
    return count


def _count_visible(value: str) -> int:
    """CUDA reads CUDA_VISIBLE_DEVICES up to its first invalid entry (e.g. -1, which hides all)."""
    count = 0
    for entry in value.split(","):
        entry = entry.strip()
        if not entry or entry.startswith("-"):
            break
        count += 1
    return count

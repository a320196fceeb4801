"""The GPU's clocks, power, temperature and clock-event reasons while a benchmark runs, sampled
from `nvidia-smi` in a background thread, so that a slow figure can be told apart from a slowed
GPU. An H100 run (2026-11-28) measured the 8B engine at 0.37x its figure from three days before
with nothing in the generated code changed between them (the one kernel change compiles to the
same PTX); without the clocks no one could say whether the GPU had throttled.

    with GpuClockSampler() as clocks:
        ...  # the timed work
    result["gpu_clocks"] = clocks.summary()

Where `nvidia-smi` is missing or fails, the summary says why instead of raising: a benchmark
never stops for want of its diagnostics.
"""

from __future__ import annotations

import shutil
import subprocess
import threading
from types import TracebackType
from typing import Any

FIELDS = ("clocks.sm", "clocks.max.sm", "power.draw", "temperature.gpu",
          "clocks_event_reasons.active")
QUERY_TIMEOUT_S = 10.0
# The reasons (nvmlClocksEventReasons) that mean the GPU ran slower than it could for a cause of
# its own, not for want of work: the power cap, thermal limits, the hardware's slowdown signal.
SLOWDOWN_REASONS = {0x4: "sw_power_cap", 0x8: "hw_slowdown", 0x20: "sw_thermal_slowdown",
                    0x40: "hw_thermal_slowdown", 0x80: "hw_power_brake_slowdown"}


def query(device_index: int = 0, binary: str = "nvidia-smi") -> dict[str, float] | str:
    """One sample of FIELDS for one GPU, or why there is none."""
    path = shutil.which(binary)
    if path is None:
        return f"{binary} not found"
    try:
        done = subprocess.run(
            [path, f"--id={device_index}", f"--query-gpu={','.join(FIELDS)}",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=QUERY_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{binary} failed: {type(exc).__name__}: {exc}"
    if done.returncode != 0:
        return f"{binary} exited {done.returncode}: {done.stderr.strip()[:200]}"
    return parse_line(done.stdout.strip().splitlines()[0] if done.stdout.strip() else "")


def parse_line(line: str) -> dict[str, float] | str:
    """FIELDS from one CSV line of nvidia-smi (the reasons bitmask in hex), or why not."""
    parts = [p.strip() for p in line.split(",")]
    if len(parts) != len(FIELDS):
        return f"unexpected nvidia-smi line: {line[:200]!r}"
    try:
        values = [float(p) for p in parts[:-1]] + [float(int(parts[-1], 16))]
    except ValueError:
        return f"unexpected nvidia-smi line: {line[:200]!r}"
    return dict(zip(FIELDS, values))


def summarise(samples: list[dict[str, float]], errors: list[str]) -> dict[str, Any]:
    """The lowest SM clock against the highest allowed, the peaks of power and temperature, and
    every slowdown reason any sample showed."""
    if not samples:
        return {"samples": 0, "error": errors[0] if errors else "no sample taken"}
    reasons = 0
    for s in samples:
        reasons |= int(s["clocks_event_reasons.active"])
    return {"samples": len(samples),
            "sm_mhz_min": min(s["clocks.sm"] for s in samples),
            "sm_mhz_median": sorted(s["clocks.sm"] for s in samples)[len(samples) // 2],
            "sm_mhz_max_allowed": max(s["clocks.max.sm"] for s in samples),
            "power_w_max": max(s["power.draw"] for s in samples),
            "temperature_c_max": max(s["temperature.gpu"] for s in samples),
            "reasons_mask": hex(reasons),
            "slowdown_reasons": [name for bit, name in SLOWDOWN_REASONS.items() if reasons & bit]}


class GpuClockSampler:
    """Samples `query` every `interval_s` from entry to exit (and once at each end)."""

    def __init__(self, interval_s: float = 0.5, device_index: int = 0,
                 binary: str = "nvidia-smi") -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.device_index = device_index
        self.binary = binary
        self.samples: list[dict[str, float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)

    def _take(self) -> None:
        sample = query(self.device_index, self.binary)
        if isinstance(sample, str):
            self.errors.append(sample)
        else:
            self.samples.append(sample)

    def _run(self) -> None:
        self._take()
        while not self._stop.wait(self.interval_s):
            self._take()

    def __enter__(self) -> GpuClockSampler:
        self._thread.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(timeout=QUERY_TIMEOUT_S + 1)
        self._take()

    def summary(self) -> dict[str, Any]:
        return summarise(self.samples, self.errors)

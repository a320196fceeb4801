"""Service-level objectives of a load test, read from a YAML file and judged at the end of a run.

    ttft:  {percentile: 90, max_ms: 5000}   # 90% of first tokens within 5 s
    itl:   {percentile: 99, max_ms: 1000}   # 99% of inter-token gaps within 1 s
    max_error_rate: 0.01                    # at most 1% of requests may fail

Plain Python: the verdict takes percentiles and counts, not Locust objects."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"ttft", "itl", "max_error_rate"}


@dataclass(frozen=True)
class LatencySLO:
    name: str  # the Locust entry it applies to: "TTFT" or "ITL"
    percentile: float  # in (0, 100)
    max_ms: float

    def __post_init__(self) -> None:
        if not 0 < self.percentile < 100:
            raise ValueError(f"{self.name.lower()}.percentile must be in (0, 100), got "
                             f"{self.percentile}")
        if not self.max_ms > 0:
            raise ValueError(f"{self.name.lower()}.max_ms must be > 0, got {self.max_ms}")


@dataclass(frozen=True)
class SLO:
    ttft: LatencySLO
    itl: LatencySLO
    max_error_rate: float

    def __post_init__(self) -> None:
        if not 0 <= self.max_error_rate <= 1:
            raise ValueError(f"max_error_rate must be in [0, 1], got {self.max_error_rate}")

    @classmethod
    def from_yaml(cls, path: str | Path) -> SLO:
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: an SLO file is a mapping, got {type(raw).__name__}")
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "SLO") -> SLO:
        unknown = set(raw) - KNOWN_KEYS
        missing = KNOWN_KEYS - set(raw)
        if unknown or missing:
            raise ValueError(f"{source}: unknown keys {sorted(unknown)}, missing keys "
                             f"{sorted(missing)}; expected {sorted(KNOWN_KEYS)}")
        return cls(_latency("TTFT", raw["ttft"], source), _latency("ITL", raw["itl"], source),
                   float(raw["max_error_rate"]))


def _latency(name: str, raw: Any, source: str) -> LatencySLO:
    if not isinstance(raw, dict) or set(raw) != {"percentile", "max_ms"}:
        raise ValueError(f"{source}: {name.lower()} must be {{percentile: P, max_ms: M}}, "
                         f"got {raw!r}")
    return LatencySLO(name, float(raw["percentile"]), float(raw["max_ms"]))


@dataclass(frozen=True)
class Verdict:
    entry: str
    target: str
    measured: str
    met: bool

    def line(self) -> str:
        return (f"{'PASS' if self.met else 'FAIL'}  {self.entry:<10} target {self.target:<22} "
                f"measured {self.measured}")


def judge(slo: SLO, percentile_ms: dict[str, float | None], requests: int,
          failures: int) -> list[Verdict]:
    """One verdict per SLO. `percentile_ms[name]` is the measured value at that entry's own
    percentile (None when the entry saw no sample, which fails it), `requests` counts every
    request that ended (completed or failed)."""
    verdicts = []
    for latency in (slo.ttft, slo.itl):
        value = percentile_ms.get(latency.name)
        verdicts.append(Verdict(
            latency.name, f"p{latency.percentile:g} <= {latency.max_ms:g} ms",
            "no samples" if value is None else f"p{latency.percentile:g} = {value:.0f} ms",
            value is not None and value <= latency.max_ms))
    rate = failures / requests if requests else 1.0
    verdicts.append(Verdict("errors", f"rate <= {slo.max_error_rate:.2%}",
                            f"{failures}/{requests} = {rate:.2%}",
                            requests > 0 and rate <= slo.max_error_rate))
    completed = requests - failures
    verdicts.append(Verdict("completed", ">= 1 request", f"{completed} requests", completed > 0))
    return verdicts

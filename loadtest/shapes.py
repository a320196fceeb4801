"""Load shapes as pure functions of time: how many users, spawned how fast, at second `t`
(None ends the test). The locustfile's one LoadTestShape class delegates here, picked by
`--shape`, so the shapes are testable without Locust."""

from __future__ import annotations

import math
from dataclasses import dataclass

SHAPES = ("constant", "ramp", "step", "burst", "pulse")
MAX_USERS = 256  # every load run is bounded


@dataclass(frozen=True)
class ShapeSpec:
    kind: str = "constant"
    users: int = 4  # peak users
    spawn_rate: float = 4.0  # users started per second
    duration_s: float = 60.0
    steps: int = 4  # step: users rise in this many equal steps
    burst_period_s: float = 20.0  # burst: every period, `users` for `burst_s`, else a quarter
    burst_s: float = 5.0

    def __post_init__(self) -> None:
        if self.kind not in SHAPES:
            raise ValueError(f"--shape must be one of {', '.join(SHAPES)}, got {self.kind!r}")
        if not 1 <= self.users <= MAX_USERS:
            raise ValueError(f"--users must be in [1, {MAX_USERS}], got {self.users}")
        if not (self.spawn_rate > 0 and self.duration_s > 0 and self.steps >= 1):
            raise ValueError("spawn rate and duration must be > 0 and steps >= 1")
        if not 0 < self.burst_s <= self.burst_period_s:
            raise ValueError(f"burst_s must be in (0, burst_period_s], got {self.burst_s}")


def users_at(spec: ShapeSpec, t: float) -> tuple[int, float] | None:
    if t >= spec.duration_s:
        return None
    if spec.kind == "constant":
        users = spec.users
    elif spec.kind == "ramp":
        users = math.ceil(spec.users * (t + 1e-9) / spec.duration_s)
    elif spec.kind == "step":
        step = math.floor(spec.steps * t / spec.duration_s) + 1
        users = math.ceil(spec.users * step / spec.steps)
    elif spec.kind == "pulse":  # a quarter of the users, all of them for the middle third
        high = spec.duration_s / 3 <= t < 2 * spec.duration_s / 3
        users = spec.users if high else max(1, spec.users // 4)
    else:  # burst: a quarter of the users, and all of them during each burst window
        in_burst = (t % spec.burst_period_s) >= spec.burst_period_s - spec.burst_s
        users = spec.users if in_burst else max(1, spec.users // 4)
        return users, float(spec.users)  # a burst arrives at once
    return max(1, min(users, spec.users)), spec.spawn_rate

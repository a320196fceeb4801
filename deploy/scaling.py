"""The autoscaler's policy: from what the router saw over the last interval (latency percentiles
against the load tests' SLO, its queue, the decode workers' KV use, the prefill backlog), whether
to add or remove a prefill or decode worker — within each role's bounds, never the last — and
whether decode workers should prefill short prompts themselves (conditional disaggregation).
Plain Python, no ray: tested with made-up signals.

Which role changes: with a profile and a workload (autoscale.profile/workload) the planner's
model (planner.plan.evaluate) simulates the candidate splits at the observed request rate and the
best goodput wins; without them the signals decide: inter-token latency or KV use point at
decode, time to first token, the router's queue or a prefill backlog at prefill."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from loadtest.slo import SLO

ROLES = ("prefill", "decode")
QUEUE_SHARE = 0.5  # queueing before compute past this share of the TTFT bound: add capacity
# (prefill, decode) workers, request rate -> the candidate's simulated goodput
SplitScore = Callable[[int, int, float], float]


@dataclass(frozen=True)
class Signals:
    """The cluster over the last interval, as the router reports it."""

    ttft_ms: float | None  # at the SLO's TTFT percentile (None: no first token in the window)
    itl_ms: float | None  # at the SLO's ITL percentile
    request_rate: float  # requests ended per second
    queued: int  # requests waiting in the router for a slot, now
    prefill_backlog_tokens: int  # prompt tokens queued on the prefill workers, now
    kv_use: float  # the decode workers' mean share of KV blocks in use, now
    workers: dict[str, int]  # role -> workers taking work (not draining), or starting
    registered: frozenset[str] = frozenset()  # every worker id the router knows
    # At the SLO's TTFT percentile: the time before a prompt's compute starts (the router's
    # queue plus a prefill worker's): it grows before TTFT passes its bound
    queue_ms: float | None = None


@dataclass(frozen=True)
class Bounds:
    min: int
    max: int


@dataclass(frozen=True)
class Decision:
    action: str  # add, remove or hold
    role: str  # prefill or decode ("" when holding)
    reason: str
    local_prefill: str | None = None  # set: the router's --local-prefill becomes this

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


class ScalingPolicy:
    def __init__(self, slo: SLO, bounds: dict[str, Bounds], cooldown_s: float,
                 scale_down_below: float = 0.5, kv_high: float = 0.85,
                 split_score: SplitScore | None = None,
                 clock: Callable[[], float] = time.monotonic, scale_down_window_s: float = 0.0):
        self.slo = slo
        self.bounds = bounds
        self.cooldown_s = cooldown_s
        self.scale_down_below = scale_down_below
        # A worker goes only once the load stayed low this long (as Kubernetes' autoscaler
        # stabilizes scale-down): one quiet reading between bursts must not remove one.
        self.scale_down_window_s = scale_down_window_s
        self._low_since: float | None = None
        self.kv_high = kv_high
        self.split_score = split_score
        self._clock = clock
        self._changed_at = -float("inf")
        self.local_prefill = "auto"

    def decide(self, s: Signals) -> Decision:
        decision = self._below_min(s) or self._decide(s)
        if decision.action != "hold":
            self._changed_at = self._clock()
            self._low_since = None  # the next removal waits a whole window at the new size
        if decision.local_prefill is not None:
            self.local_prefill = decision.local_prefill
        return decision

    def hold_off(self) -> None:
        """Make no change for a cooldown from now (the controller restarted: it knows nothing
        of the last change)."""
        self._changed_at = self._clock()

    def _below_min(self, s: Signals) -> Decision | None:
        """A role under its minimum (its workers died) gets one back, cooldown or not."""
        for role in ROLES:
            if s.workers.get(role, 0) < self.bounds[role].min:
                return Decision("add", role, f"{s.workers.get(role, 0)} {role} workers, below "
                                f"the minimum of {self.bounds[role].min}")
        return None

    def _decide(self, s: Signals) -> Decision:
        ttft, itl = _ratio(s.ttft_ms, self.slo.ttft.max_ms), _ratio(s.itl_ms, self.slo.itl.max_ms)
        queue = _ratio(s.queue_ms, self.slo.ttft.max_ms)
        decode_bound = itl > 1 or s.kv_use > self.kv_high
        prefill_bound = ttft > 1 or s.queued > 0 or queue > QUEUE_SHARE
        flip = self._flip(decode_bound, prefill_bound)
        if decode_bound or prefill_bound:
            self._low_since = None
        if self._clock() - self._changed_at < self.cooldown_s:
            return Decision("hold", "", "cooling down after the last change", flip)
        if decode_bound or prefill_bound:
            role = self._role_to_add(s, decode_bound, prefill_bound)
            if role is None:
                return Decision("hold", "", "over the SLO, but every role that would help is "
                                "at its max", flip)
            return Decision("add", role, _why(s, ttft, itl, self.kv_high), flip)
        low = self.scale_down_below
        quiet = ttft < low and itl < low and s.queued == 0 and s.kv_use < self.kv_high / 2
        now = self._clock()
        if not quiet:
            self._low_since = None
        elif self._low_since is None:
            self._low_since = now
        if self._low_since is not None and now - self._low_since >= self.scale_down_window_s:
            role = self._role_to_remove(s)
            if role is not None:
                return Decision("remove", role, f"TTFT at {ttft:.0%} and ITL at {itl:.0%} of "
                                f"the SLO, KV use {s.kv_use:.0%}, nothing queued", flip)
        return Decision("hold", "", "within the SLO", flip)

    def _flip(self, decode_bound: bool, prefill_bound: bool) -> str | None:
        """Decode workers stop prefilling short prompts while decoding is the bottleneck, and
        start again when only prefill is."""
        if decode_bound and self.local_prefill == "auto":
            return "off"
        if prefill_bound and not decode_bound and self.local_prefill == "off":
            return "auto"
        return None

    def _room(self, s: Signals, role: str, step: int) -> bool:
        count = s.workers.get(role, 0) + step
        return count <= self.bounds[role].max if step > 0 else count >= self.bounds[role].min

    def _role_to_add(self, s: Signals, decode_bound: bool, prefill_bound: bool) -> str | None:
        open_roles = [r for r in ROLES if self._room(s, r, +1)]
        if self.split_score is not None and open_roles:
            return self._best(s, open_roles, +1)
        wanted = (["decode"] if decode_bound else []) + (["prefill"] if prefill_bound else [])
        if prefill_bound and not decode_bound:
            wanted.append("decode")  # a decode worker can prefill short prompts itself
        return next((r for r in wanted if r in open_roles), None)

    def _role_to_remove(self, s: Signals) -> str | None:
        open_roles = [r for r in ROLES if self._room(s, r, -1)]
        if self.split_score is not None and open_roles:
            return self._best(s, open_roles, -1)
        if s.prefill_backlog_tokens == 0 and "prefill" in open_roles:
            return "prefill"
        return "decode" if "decode" in open_roles else None

    def _best(self, s: Signals, roles: list[str], step: int) -> str:
        """The role whose change leaves the split with the best simulated goodput."""
        assert self.split_score is not None
        p, d = s.workers.get("prefill", 0), s.workers.get("decode", 0)
        rate = max(s.request_rate, 1e-3)
        scores = {r: self.split_score(p + step * (r == "prefill"), d + step * (r == "decode"),
                                      rate) for r in roles}
        return max(roles, key=lambda r: (scores[r], r == "decode"))


def _ratio(value_ms: float | None, bound_ms: float) -> float:
    return 0.0 if value_ms is None else value_ms / bound_ms


def _why(s: Signals, ttft: float, itl: float, kv_high: float) -> str:
    parts = [f"TTFT at {ttft:.0%} of the SLO", f"ITL at {itl:.0%}",
             f"KV use {s.kv_use:.0%} (high: {kv_high:.0%})"]
    if s.queue_ms:
        parts.append(f"{s.queue_ms:.0f} ms queued before compute")
    if s.queued:
        parts.append(f"{s.queued} queued in the router")
    if s.prefill_backlog_tokens:
        parts.append(f"{s.prefill_backlog_tokens} prompt tokens queued on prefill workers")
    return ", ".join(parts)

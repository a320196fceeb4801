"""A discrete-event model of a cluster serving a workload, for the P:D planner (planner.plan).
Plain Python: workers are step loops whose step time comes from a measured Profile
(engine.profile), the router's placement and its conditional-disaggregation policy are the real
one's rules (`router.policy.prefill_site` itself), and every request's TTFT and inter-token
gaps come out.

Each worker runs the engine's step: the running requests decode one token each, and waiting
prompts fill the rest of the 512-token budget (a prefill or colocated worker: up to the budget per
prompt; a decode worker prefilling locally: `local_chunk` tokens), shortest first within the age
bound (the workers' default). A prompt prefilled remotely joins its decode worker's batch the step
after it completes (KV transfer: negligible, ~0.2% of TTFT measured on one host). Not modelled:
prefix-cache hits, preemption, the router's own queue.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field

from router.policy.prefill_site import PrefillSiteConfig, PrefillSitePolicy, SiteInputs

STEP_TOKENS = 512  # the workers' step budget
AGE_BOUND_S = 4.0  # short_first: older waiting prompts go first


@dataclass(frozen=True)
class Profile:
    """One worker's measured speed (engine.profile's JSON)."""

    per_step_s: float  # a prefill-only step's overhead
    per_token_s: float
    per_token2_s: float  # prefill tokens × context: attention
    decode_base_s: float  # a decode step's overhead
    decode_per_seq_s: float

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not value >= 0:
                raise ValueError(f"profile {name} must be >= 0, got {value}")

    @classmethod
    def from_json(cls, data: dict) -> Profile:
        try:
            prefill, decode = data["prefill"], data["decode"]
            return cls(float(prefill["per_step_s"]), float(prefill["per_token_s"]),
                       float(prefill["per_token2_s"]), float(decode["base_s"]),
                       float(decode["per_seq_s"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not a profile (python -m engine.profile writes one): {exc}") from exc

    def prefill_s(self, start: int, end: int) -> float:
        """Compute for prompt tokens [start, end) of one request."""
        return self.per_token_s * (end - start) + self.per_token2_s * (end * end - start * start)

    def step_s(self, decodes: int, prefill_s: float) -> float:
        overhead = self.decode_base_s if decodes else self.per_step_s
        return overhead + self.decode_per_seq_s * decodes + prefill_s


@dataclass
class SimRequest:
    arrival: float
    prompt_tokens: int
    max_tokens: int
    computed: int = 0
    tokens: int = 0
    first_token: float | None = None
    last_token: float = 0.0
    gaps: list[float] = field(default_factory=list)
    end: float | None = None
    site: str = ""  # remote, local or colocated
    decode_at: SimWorker | None = None  # prefilled remotely: the decode worker it joins

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        return sum(self.gaps) / len(self.gaps) if self.gaps else None


@dataclass
class SimWorker:
    role: str  # prefill, decode or colocated
    chunk: int  # prompt tokens one request computes per step
    profile: Profile  # its speed, at its tensor-parallel size
    waiting: list[SimRequest] = field(default_factory=list)
    running: list[SimRequest] = field(default_factory=list)
    incoming: int = 0  # placed here to decode, prefilled elsewhere
    busy: bool = False

    @property
    def queued_tokens(self) -> int:
        return sum(r.prompt_tokens - r.computed for r in self.waiting)


@dataclass(frozen=True)
class Topology:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    local_prefill: str = "auto"  # the router's --local-prefill (P:D only)
    local_chunk: int = 32  # a decode worker's --prefill-chunk-size
    prefill_tp: int = 1  # ranks (devices) per prefill worker
    decode_tp: int = 1  # ranks per decode worker, and per colocated worker

    def __post_init__(self) -> None:
        if self.prefill_tp < 1 or self.decode_tp < 1:
            raise ValueError(f"tensor-parallel sizes must be >= 1, got prefill "
                             f"{self.prefill_tp}, decode {self.decode_tp}")

    @property
    def devices(self) -> int:
        """The cores or GPUs its workers' ranks take."""
        return self.prefill * self.prefill_tp + (self.decode + self.colocated) * self.decode_tp

    @property
    def name(self) -> str:
        if self.colocated:
            return f"colocated{self.colocated}" + self._tp_name(self.decode_tp)
        return (f"{self.prefill}p{self._tp_name(self.prefill_tp)}"
                f"{self.decode}d{self._tp_name(self.decode_tp)}"
                + ("" if self.local_prefill == "auto" else f" local-prefill {self.local_prefill}"))

    @staticmethod
    def _tp_name(tp: int) -> str:
        return f"(tp{tp})" if tp > 1 else ""

    @property
    def launch_args(self) -> str:
        """`python -m router launch` flags for this topology."""
        if self.colocated:
            return f"--colocated {self.colocated}" + (f" -tp {self.decode_tp}"
                                                       if self.decode_tp > 1 else "")
        tp = "".join(f" --{role}-tp {size}" for role, size in
                     (("prefill", self.prefill_tp), ("decode", self.decode_tp)) if size > 1)
        return f"--prefill {self.prefill} --decode {self.decode}{tp} " \
               f"--local-prefill {self.local_prefill}"


class ClusterSim:
    def __init__(self, topology: Topology, profiles: Profile | Mapping[int, Profile]):
        """`profiles`: a worker's speed by tensor-parallel size (a Profile alone: TP 1)."""
        by_tp = {1: profiles} if isinstance(profiles, Profile) else dict(profiles)
        for tp in (topology.prefill_tp, topology.decode_tp):
            if tp not in by_tp:
                raise ValueError(f"no profile of a worker at tensor-parallel size {tp} "
                                 f"(profiles for: {sorted(by_tp)})")
        prefill, decode = by_tp[topology.prefill_tp], by_tp[topology.decode_tp]
        self.site = PrefillSitePolicy(PrefillSiteConfig(mode=topology.local_prefill))
        self.prefill = [SimWorker("prefill", STEP_TOKENS, prefill)
                        for _ in range(topology.prefill)]
        self.decode = [SimWorker("decode", topology.local_chunk, decode)
                       for _ in range(topology.decode)]
        self.colocated = [SimWorker("colocated", STEP_TOKENS, decode)
                          for _ in range(topology.colocated)]
        self._events: list[tuple[float, int, object]] = []
        self._seq = itertools.count()

    def run(self, arrivals: list[tuple[float, int, int]]) -> list[SimRequest]:
        """Serve (arrival s, prompt tokens, max tokens) requests; every request, finished."""
        requests = [SimRequest(a, p, m) for a, p, m in arrivals]
        for request in requests:
            self._push(request.arrival, request)
        while self._events:
            now, _, item = heapq.heappop(self._events)
            if isinstance(item, SimRequest):
                self._place(item, now)
            else:
                self._end_step(now, *item)
        return requests

    def _push(self, at: float, item: object) -> None:
        heapq.heappush(self._events, (at, next(self._seq), item))

    def _place(self, request: SimRequest, now: float) -> None:
        if self.colocated:
            worker = min(self.colocated, key=lambda w: (w.queued_tokens, len(w.running)))
            request.site = "colocated"
            self._enqueue(worker, request, now)
            return
        decode = min(self.decode, key=lambda w: (len(w.running) + w.incoming + len(w.waiting),
                                                 w.queued_tokens))
        pool = min(self.prefill, key=lambda w: w.queued_tokens)
        decision = self.site.decide(SiteInputs(request.prompt_tokens, 0, decode.queued_tokens,
                                               pool.queued_tokens + request.prompt_tokens,
                                               decode.chunk))
        request.site = decision.site
        if decision.local:
            self._enqueue(decode, request, now)
        else:
            decode.incoming += 1
            self._enqueue(pool, request, now, then=decode)

    def _enqueue(self, worker: SimWorker, request: SimRequest, now: float,
                 then: SimWorker | None = None) -> None:
        request.decode_at = then
        worker.waiting.append(request)
        self._start_step(worker, now)

    def _start_step(self, worker: SimWorker, now: float) -> None:
        if worker.busy or not (worker.waiting or worker.running):
            return
        decodes = list(worker.running)
        budget, cost, chunks = STEP_TOKENS - len(decodes), 0.0, []
        for request in sorted(worker.waiting, key=lambda r: _urgency(r, now)):
            take = min(request.prompt_tokens - request.computed, worker.chunk, budget)
            if take <= 0:
                break
            cost += worker.profile.prefill_s(request.computed, request.computed + take)
            chunks.append((request, take))
            budget -= take
        worker.busy = True
        self._push(now + worker.profile.step_s(len(decodes), cost), (worker, decodes, chunks))

    def _end_step(self, now: float, worker: SimWorker, decodes: list[SimRequest],
                  chunks: list[tuple[SimRequest, int]]) -> None:
        worker.busy = False
        for request in decodes:
            request.gaps.append(now - request.last_token)
            self._token(worker, request, now)
        for request, take in chunks:
            request.computed += take
            if request.computed < request.prompt_tokens:
                continue
            worker.waiting.remove(request)
            request.first_token = now
            target = request.decode_at or worker
            if target is not worker:
                target.incoming -= 1
            target.running.append(request)
            self._token(target, request, now)
            if target is not worker:
                self._start_step(target, now)
        self._start_step(worker, now)

    @staticmethod
    def _token(worker: SimWorker, request: SimRequest, now: float) -> None:
        request.tokens += 1
        request.last_token = now
        if request.tokens >= request.max_tokens:
            request.end = now
            worker.running.remove(request)


def _urgency(request: SimRequest, now: float) -> tuple:
    """short_first within the age bound (engine.scheduler's order for waiting prompts)."""
    aged = now - request.arrival > AGE_BOUND_S
    return (0, request.arrival) if aged else (1, request.prompt_tokens - request.computed)

"""The order the scheduler serves requests in (SchedulerConfig.queue_policy). Plain Python.

"fcfs" keeps arrival order. "short_first", after every running decode, serves the prompts with
the fewest tokens left to compute first — running prefills and waiting prompts alike — unless a
request has waited longer than `queue_age_bound_s` (then oldest first), so long prompts cannot
starve; preempted requests are readmitted before anything else, as with fcfs.
"""

from __future__ import annotations

from collections.abc import Iterable

from engine.config import SchedulerConfig
from engine.request import Request


def urgency(request: Request, now: float, age_bound_s: float) -> tuple[int, float, float]:
    """short_first sort key: overdue requests oldest first, then fewest tokens left (ties:
    earlier arrival). Sorts are stable, so equal keys keep their queue order."""
    if now - request.arrival_time > age_bound_s:
        return (1, request.arrival_time, 0.0)
    return (2, request.num_tokens - request.num_computed_tokens, request.arrival_time)


def running_order(running: list[Request], waiting: Iterable[Request], config: SchedulerConfig,
                  now: float) -> tuple[list[Request], list[Request]]:
    """The order running requests get budget in: before the waiting queue, and after it
    (short_first: running prefills that the most urgent waiting prompt outranks, so a chat turn
    arriving during a document's chunked prefill does not wait for all of it). `running`
    itself stays in admission order: preemption takes `running[-1]`."""
    if config.queue_policy != "short_first":
        return list(running), []
    bound = config.queue_age_bound_s
    decodes: list[Request] = []
    prefills: list[Request] = []
    for request in running:
        left = request.num_tokens - request.num_computed_tokens
        (prefills if left > 1 else decodes).append(request)
    prefills.sort(key=lambda r: urgency(r, now, bound))
    fresh = [urgency(r, now, bound) for r in waiting if not r.num_preemptions]
    if not fresh or len(running) >= config.max_num_seqs:
        return decodes + prefills, []
    best = min(fresh)
    ahead = [r for r in prefills if urgency(r, now, bound) <= best]
    return decodes + ahead, prefills[len(ahead):]


def waiting_order(waiting: Iterable[Request], config: SchedulerConfig, now: float
                  ) -> list[Request]:
    order = list(waiting)
    if config.queue_policy == "short_first":
        # Preempted requests sit at the front of the queue (Scheduler._preempt) and stay first.
        order.sort(key=lambda r: (0, 0.0, 0.0) if r.num_preemptions
                   else urgency(r, now, config.queue_age_bound_s))
    return order

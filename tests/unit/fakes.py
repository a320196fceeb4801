"""A model-free driver for the scheduler: tokens depend only on a request's token history, so
any correct schedule (chunked, preempted, prefix-cached) yields the same outputs."""

from __future__ import annotations

from engine.block_manager import BlockManager
from engine.config import SchedulerConfig
from engine.request import Request, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput

EOS = 2


def next_token(tokens: list[int]) -> int:
    return 3 + (sum((i + 1) * t for i, t in enumerate(tokens[-8:])) * 31 + len(tokens)) % 997


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_seqs: int = 8,
                   chunk: int | None = None, prefix_caching: bool = True) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                             max_model_len=4096, prefill_chunk_size=chunk)
    return Scheduler(config, BlockManager(num_blocks, block_size, prefix_caching))


def make_request(rid: str, prompt: list[int], max_tokens: int = 8, **kw: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw),
                   eos_token_ids=(EOS,))


def fake_execute(out: SchedulerOutput) -> list[int | None]:
    """What a model would sample: a token for each request whose step reaches its last token."""
    return [next_token(s.request.all_token_ids) if s.samples else None for s in out.scheduled]


def step(scheduler: Scheduler) -> SchedulerOutput:
    """One schedule → execute → update step, with the integrity check after it."""
    out = scheduler.schedule()
    scheduler.update(out, fake_execute(out))
    live = list(scheduler.requests.values())  # running, waiting and paused
    scheduler.block_manager.check_integrity(live)
    return out


def run_all(scheduler: Scheduler, max_steps: int = 10_000) -> list[SchedulerOutput]:
    steps = []
    while scheduler.has_unfinished():
        steps.append(step(scheduler))
        assert len(steps) < max_steps, "scheduler made no progress"
    return steps


def expected_output(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    out = []
    for _ in range(max_tokens):
        t = next_token(tokens)
        tokens.append(t)
        out.append(t)
    return out

"""The samples of one prompt (OpenAI's `n`) share its KV: the first sample computes the prompt, and
the others fork from it. Plain Python, no torch.

When a request that expects forks (`Request.forks_expected`) has its prompt computed, its
prompt's blocks are held as a *fork source*: a holder takes a reference on each of them, so they
outlive the request itself (it may finish at its first token, or be preempted). A fork is a new
request with the same prompt that

- shares every block before the one holding the prompt's last position, by reference count;
- gets a fresh block for that last one, which the model runner fills with a copy of the source's
  (copy-on-write: the fork writes its own tokens there, the source's stays as it was);
- starts with every prompt position but the last computed: its first step computes that one
  position again (a decode row) for the logits its first token is sampled from, with its own seed.

A source lasts until its forks are all taken, its lease ends, or the scheduler needs its blocks
for running requests (a source is an optimisation: a fork that finds none prefills its prompt,
and the prefix cache serves what it still holds).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.request import Request

FORK_LEASE_S = 20.0  # a source whose forks have not all come by then is given up


@dataclass
class ForkSource:
    holder: Request  # holds a reference on each of the prompt's blocks
    left: int  # forks still expected
    expires: float


class ForkSources:
    def __init__(self, block_manager: BlockManager, clock: Callable[[], float] = time.monotonic,
                 lease_s: float = FORK_LEASE_S):
        self.block_manager = block_manager
        self.clock = clock
        self.lease_s = lease_s
        self._sources: OrderedDict[str, ForkSource] = OrderedDict()  # oldest first
        self.num_forked = 0  # forks served from a source (for metrics and tests)

    def __len__(self) -> int:
        return len(self._sources)

    def holders(self) -> list[Request]:
        return [s.holder for s in self._sources.values()]

    def hold(self, request: Request) -> None:
        """Keep the prompt blocks of `request` (its prompt computed) for its expected forks.
        Nothing is held when it no longer has them (preempted meanwhile, under async
        scheduling): its forks then prefill on their own."""
        count, request.forks_expected = request.forks_expected, 0
        if count <= 0 or request.request_id in self._sources:
            return
        num_blocks = self.block_manager.blocks_needed(request.num_prompt_tokens)
        if len(request.block_ids) < num_blocks or request.num_released_blocks:
            return  # (a released block may be another request's by now)
        holder = Request(f"{request.request_id}#fork-source", request.prompt_token_ids,
                         request.params)
        self.block_manager.share(holder, request.block_ids[:num_blocks])
        self._sources[request.request_id] = ForkSource(holder, count,
                                                       self.clock() + self.lease_s)

    def take(self, source_id: str, fork: Request) -> list[tuple[int, int]] | None:
        """Give `fork` (a new request holding no blocks) the source's prompt: the blocks it shares
        and one fresh block for the last position. Returns the (source block, fresh block) copy
        the model runner must make before the fork's first step; None (nothing changed) when there
        is no such source, its prompt differs, or no block is free."""
        source = self._sources.get(source_id)
        if source is None or source.holder.prompt_token_ids != fork.prompt_token_ids:
            return None
        if fork.block_ids or fork.num_computed_tokens or fork.output_token_ids:
            raise RuntimeError(f"request {fork.request_id} is not new: it cannot fork")
        bm = self.block_manager
        last = (fork.num_prompt_tokens - 1) // bm.block_size  # the block of the last position
        bm.share(fork, source.holder.block_ids[:last])
        fork.num_computed_tokens = fork.num_prompt_tokens - 1
        if not bm.allocate_slots(fork, 1):
            bm.free(fork)
            fork.num_computed_tokens = 0
            return None
        source.left -= 1  # a spent source is released after the copy (`release_spent`)
        self.num_forked += 1
        return [(source.holder.block_ids[last], fork.block_ids[last])]

    def release_spent(self) -> None:
        """Release the sources every expected fork took (call once their copies are made)."""
        for source_id in [k for k, s in self._sources.items() if s.left <= 0]:
            self._release(source_id)

    def expire(self) -> None:
        """Give up the sources whose lease ended."""
        now = self.clock()
        for source_id in [k for k, s in self._sources.items() if s.expires <= now]:
            self._release(source_id)

    def reclaimable(self) -> int:
        """Blocks that releasing every source would free (those no request holds too)."""
        blocks = self.block_manager.blocks
        return sum(1 for s in self._sources.values() for b in s.holder.block_ids
                   if blocks[b].ref_count == 1)

    def release_reclaimable(self) -> bool:
        """Give up the oldest source whose release frees a block (the scheduler needs blocks);
        False when none would."""
        blocks = self.block_manager.blocks
        for source_id, source in self._sources.items():
            if any(blocks[b].ref_count == 1 for b in source.holder.block_ids):
                self._release(source_id)
                return True
        return False

    def release_all(self) -> None:
        for source_id in list(self._sources):
            self._release(source_id)

    def _release(self, source_id: str) -> None:
        source = self._sources.pop(source_id)
        self.block_manager.free(source.holder)

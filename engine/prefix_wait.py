"""Waiting prompts that share a prefix a running request is still computing wait for it, rather
than compute the same prefix again. Plain Python, no torch.

A block reaches the prefix cache only once the step that computes its last position is done
(Scheduler.update). So when many prompts with one system prompt arrive together, the first is
admitted and, in the same step or while its chunks run, every prompt admitted beside it misses
the cache and computes the shared prefix itself. Held back until the first has computed it,
they find it cached and compute only their own suffix. SGLang's scheduler does the same for
prompts that share a prefix within one batch ("in-batch prefix caching"); vLLM does not.

The wait is short and bounded: running requests get their budget before waiting ones, so the
prefix's owner computes it at the step budget's pace, and a waiting prompt held back would have
spent that budget computing the same positions. It ends when the owner has published the shared
blocks, or stops being a running request (finished, aborted, preempted, paused).
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.block_manager import BlockManager
from engine.request import Request

# A shared stretch shorter than this is computed again rather than waited for: waiting can
# cost the prompt a step, which a couple of blocks' compute does not repay.
MIN_SHARED_TOKENS = 32


class PrefixesInFlight:
    """The prompt blocks that running requests compute but have not yet published to the prefix
    cache, for one schedule pass. Built lazily (only when a waiting prompt misses the cache);
    requests admitted during the pass join `running` and are taken in when next asked."""

    def __init__(self, block_manager: BlockManager, running: Sequence[Request]):
        self._block_manager = block_manager
        self._block_size = block_manager.block_size
        self._enabled = block_manager.enable_prefix_caching
        self._running = running
        self._keys: set[int] = set()
        self._seen = 0  # running[:_seen] are taken in

    def should_wait(self, request: Request, num_hit_blocks: int) -> bool:
        """Whether `request`, whose first `num_hit_blocks` blocks are cache hits, shares at least
        MIN_SHARED_TOKENS of its next prompt blocks with prefixes in flight."""
        usable = (request.num_tokens - 1) // self._block_size  # as find_cached_prefix
        if not self._enabled or num_hit_blocks >= usable:
            return False
        keys = self._block_manager.prompt_keys(request)[num_hit_blocks:usable]
        in_flight = self._in_flight()
        shared = 0
        for key in keys:  # chained keys: the shared blocks are consecutive from the first miss
            if key not in in_flight:
                break
            shared += 1
        return shared * self._block_size >= MIN_SHARED_TOKENS

    def _in_flight(self) -> set[int]:
        for request in self._running[self._seen:]:
            published = len(request._block_hashes)
            if published < request.num_prompt_tokens // self._block_size:
                self._keys.update(self._block_manager.prompt_keys(request)[published:])
        self._seen = len(self._running)
        return self._keys

"""Paged KV block pool with reference counts and prefix caching. Plain Python, no torch.

Every block is in exactly one of three states:
  used    ref_count > 0 (held by one or more requests)
  cached  ref_count == 0, holds the KV of a full block whose hash is known (reusable on a hit)
  free    ref_count == 0, no hash
Cached and free blocks both live in `_evictable`, an LRU ordered from "evict first" to "evict last":
free blocks go to the front, cached blocks to the back, so a hit survives as long as possible.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.request import Request

MAX_PUBLISHED_HASHES = 32768  # a digest beyond this keeps the most recently cached blocks


def chain_hash(parent: int | None, token_ids: Sequence[int]) -> int:
    """Key of a full block: its tokens, chained to the key of the block before it. Stable across
    processes and Python versions (not `hash()`: None's hash differs per process before 3.12),
    so a router can compute the keys a worker's prefix cache holds."""
    digest = hashlib.blake2b(digest_size=8)
    digest.update((parent or 0).to_bytes(8, "little"))
    digest.update(array("q", token_ids).tobytes())
    return int.from_bytes(digest.digest(), "little")


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The keys of every full block of `token_ids`, in order."""
    keys: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = chain_hash(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    hash: int | None = None
    token_ids: tuple[int, ...] = ()  # kept with the hash so a hash collision is never a hit


@dataclass(frozen=True)
class BlockUsage:
    used: int
    cached: int
    free: int

    @property
    def total(self) -> int:
        return self.used + self.cached + self.free


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}"
            )
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._evictable: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._by_hash: dict[int, int] = {}
        self.prefix_version = 0  # changes whenever the set of cached keys does
        self.prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.prefix_hits = 0  # of which found cached
        self.released_early = 0  # blocks requests let go of once every window had passed them

    # ---- queries -------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free plus evictable cached)."""
        return len(self._evictable)

    def usage(self) -> BlockUsage:
        cached = sum(1 for b in self._evictable if self.blocks[b].hash is not None)
        free = len(self._evictable) - cached
        return BlockUsage(used=self.num_blocks - len(self._evictable), cached=cached, free=free)

    def num_allocatable(self, cached_blocks: Sequence[int] = ()) -> int:
        """Fresh blocks an allocation taking `cached_blocks` (prefix hits) could still get: hits
        that sit in the evictable pool are not available for fresh allocation."""
        return len(self._evictable) - sum(1 for b in cached_blocks if b in self._evictable)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache --------------------------------------------------------------------
    def find_cached_prefix(self, request: Request) -> list[int]:
        """Block ids holding the longest cached prefix of the request's tokens.

        At least one token is always left to compute, so the last token's logits exist.
        """
        if not self.enable_prefix_caching:
            return []
        usable = (request.num_tokens - 1) // self.block_size
        prompt_keys = self.prompt_keys(request)  # hashed once; blocks past the prompt here
        hits: list[int] = []
        parent: int | None = None
        for i in range(usable):
            tokens = tuple(request.tokens_in(i * self.block_size, (i + 1) * self.block_size))
            key = prompt_keys[i] if i < len(prompt_keys) else chain_hash(parent, tokens)
            block_id = self._by_hash.get(key)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            hits.append(block_id)
            parent = key
        return hits

    def prompt_keys(self, request: Request) -> list[int]:
        """The keys of every full block of the request's prompt, computed once per request (a
        waiting prompt is looked up at every step until it is admitted)."""
        if request.prompt_block_keys is None:
            request.prompt_block_keys = prefix_hashes(request.prompt_token_ids, self.block_size)
        return request.prompt_block_keys

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count an admitted request's prefix lookup (for the hit-rate metric)."""
        self.prefix_queries += num_tokens
        self.prefix_hits += num_hit_tokens

    def published_hashes(self, limit: int = MAX_PUBLISHED_HASHES) -> list[int]:
        """The keys of the blocks whose KV this cache holds (in use or evictable), the most
        recently cached last: what a router's cache-aware placement needs to know."""
        keys = list(self._by_hash)
        return keys[-limit:]

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def cache_full_blocks(self, request: Request) -> None:
        """Publish the hashes of the request's blocks whose every token's KV is computed."""
        if not self.enable_prefix_caching:
            return
        hashes = request._block_hashes
        full = min(request.num_computed_tokens // self.block_size, len(request.block_ids))
        if full <= len(hashes):  # no block filled since the last call: most steps
            return
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            tokens = tuple(request.tokens_in(i * self.block_size, (i + 1) * self.block_size))
            key = chain_hash(parent, tokens)
            hashes.append(key)
            parent = key
            block = self.blocks[request.block_ids[i]]
            if block.hash is None and key not in self._by_hash:
                block.hash, block.token_ids = key, tokens
                self._by_hash[key] = block.block_id
                self.prefix_version += 1

    # ---- allocation ----------------------------------------------------------------------
    def allocate_slots(
        self, request: Request, num_new_tokens: int, cached_blocks: Sequence[int] = ()
    ) -> bool:
        """Make room for `num_new_tokens` more tokens of KV; False (and no change) if it can't.

        `cached_blocks` are prefix-cache hits for a request that holds no blocks yet; they count
        as computed tokens once taken.
        """
        if not cached_blocks:  # a running request: most steps need no new block
            needed = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
            if needed <= len(request.block_ids):
                return True
        elif request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        num_computed = request.num_computed_tokens + len(cached_blocks) * self.block_size
        needed = self.blocks_needed(num_computed + num_new_tokens)
        have = len(request.block_ids) + len(cached_blocks)
        if needed - have > self.num_allocatable(cached_blocks):
            return False
        for block_id in cached_blocks:
            self._ref(block_id)
        request.block_ids.extend(cached_blocks)
        # Which blocks are evicted is the LRU's choice; the order they are handed out in is ours:
        # ascending ids keep a request's blocks in runs (freed tails come back in descending
        # order), so its KV is copied or sent a run at a time rather than a block at a time.
        request.block_ids.extend(sorted(self._take_evictable() for _ in range(needed - have)))
        return True

    def share(self, request: Request, block_ids: Sequence[int]) -> None:
        """Give `request` a reference on blocks another holder already holds (a fork of a
        prompt: engine.forks); they count as its first blocks."""
        if request.block_ids:
            raise RuntimeError(f"request {request.request_id} already holds blocks")
        for block_id in block_ids:
            if self.blocks[block_id].ref_count <= 0:
                raise RuntimeError(f"block {block_id} is not held: nothing to share")
            self._ref(block_id)
        request.block_ids.extend(block_ids)

    def free(self, request: Request) -> None:
        """Release every block of the request. Tail blocks are freed first so that, among the
        request's cached blocks, the prefix is evicted last."""
        for block_id in reversed(request.block_ids[request.num_released_blocks:]):
            self._unref(block_id)
        # A new list, not the old one cleared: engine.decode_block_table carries a decoding
        # request's row over while its block list is the same object (ids only appended)
        request.block_ids = []
        request._block_hashes.clear()
        request.num_released_blocks = 0

    def release_before(self, request: Request, upto: int) -> int:
        """Let go of the request's blocks before index `upto`, which no step will read again
        (every layer's sliding window has passed them). Only blocks whose hash is published
        (their KV complete) go; their ids stay in `block_ids` so positions keep their index —
        the attention kernels never read them (they start at the window), and another request
        may take them. Returns how many were released."""
        if self.enable_prefix_caching:
            upto = min(upto, len(request._block_hashes))
        upto = min(upto, len(request.block_ids))
        released = 0
        for index in range(request.num_released_blocks, upto):
            self._unref(request.block_ids[index])
            released += 1
        request.num_released_blocks = max(request.num_released_blocks, upto)
        self.released_early += released
        return released

    def _unref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count < 0:
            raise RuntimeError(f"block {block_id} freed more often than taken")
        if block.ref_count == 0:
            self._evictable[block_id] = None
            if block.hash is None:
                self._evictable.move_to_end(block_id, last=False)

    def check_integrity(self, holders: Sequence[Request]) -> None:
        """Raise AssertionError unless free + cached + used == total and every ref count equals
        the number of live requests holding that block (tests call this after every step)."""
        usage = self.usage()
        assert usage.total == self.num_blocks, f"{usage} does not add up to {self.num_blocks}"
        counts = [0] * self.num_blocks
        for request in holders:
            for block_id in request.block_ids[request.num_released_blocks:]:
                counts[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == counts[block.block_id], (
                f"block {block.block_id}: ref_count {block.ref_count}, "
                f"held {counts[block.block_id]}x"
            )
            assert (block.ref_count == 0) == (block.block_id in self._evictable)
        for key, block_id in self._by_hash.items():
            assert self.blocks[block_id].hash == key

    def reset_prefix_cache(self) -> None:
        for block_id in list(self._by_hash.values()):
            self._forget(self.blocks[block_id])

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._evictable[block_id]
        block.ref_count += 1

    def _take_evictable(self) -> int:
        block_id, _ = self._evictable.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)
        block.ref_count = 1
        return block_id

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self._by_hash.get(block.hash) == block.block_id:
            del self._by_hash[block.hash]
            self.prefix_version += 1
        block.hash, block.token_ids = None, ()

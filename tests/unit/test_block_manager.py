from __future__ import annotations

from engine.block_manager import BlockManager
from tests.unit.fakes import make_request


def test_allocate_and_free_round_trip():
    bm = BlockManager(10, 4)
    r = make_request("a", list(range(10, 19)))
    assert bm.allocate_slots(r, 9)
    assert len(r.block_ids) == 3 and bm.num_free_blocks == 7
    assert bm.allocate_slots(r, 0) and len(r.block_ids) == 3  # no growth needed
    bm.check_integrity([r])
    bm.free(r)
    assert r.block_ids == [] and bm.num_free_blocks == 10
    bm.check_integrity([])


def test_allocation_that_does_not_fit_changes_nothing():
    bm = BlockManager(3, 4)
    r = make_request("a", list(range(20)))
    assert not bm.allocate_slots(r, 20)
    assert r.block_ids == [] and bm.num_free_blocks == 3


def test_prefix_hashes_chain_and_hit_only_on_identical_prefixes():
    bm = BlockManager(20, 4)
    a = make_request("a", list(range(100, 113)))
    bm.allocate_slots(a, 13)
    a.num_computed_tokens = 13
    bm.cache_full_blocks(a)
    assert len(a._block_hashes) == 3
    same = make_request("b", list(range(100, 113)) + [7])
    assert bm.find_cached_prefix(same) == a.block_ids[:3]
    # A different first block breaks the chain even if later blocks match.
    other = make_request("c", [1, 2, 3, 4] + list(range(104, 113)))
    assert bm.find_cached_prefix(other) == []


def test_freed_cached_blocks_stay_reusable_until_evicted_in_lru_order():
    bm = BlockManager(6, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)  # blocks 0,1 hashed; block 2 partial
    first_blocks = list(a.block_ids)
    bm.free(a)
    usage = bm.usage()
    assert (usage.used, usage.cached, usage.free) == (0, 2, 4)
    # Unhashed blocks are handed out before cached ones.
    b = make_request("b", [9] * 8)
    bm.allocate_slots(b, 8)
    assert not set(b.block_ids) & set(first_blocks[:2])
    assert bm.find_cached_prefix(make_request("c", [1, 2, 3, 4, 6])) == first_blocks[:2]
    bm.free(b)
    bm.check_integrity([])


def test_taking_a_cached_hit_removes_it_from_the_evictable_pool():
    bm = BlockManager(4, 2)
    a = make_request("a", [1, 2, 3, 4, 5])
    bm.allocate_slots(a, 5)
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    bm.free(a)
    b = make_request("b", [1, 2, 3, 4, 9])
    hits = bm.find_cached_prefix(b)
    assert len(hits) == 2
    assert bm.allocate_slots(b, 1, hits)
    assert b.block_ids[:2] == hits and bm.num_free_blocks == 1
    bm.check_integrity([b])
    # 3 more tokens need 2 blocks but only 1 is left: refused, nothing changes.
    c = make_request("c", [7] * 4)
    assert not bm.allocate_slots(c, 4) and bm.num_free_blocks == 1


def test_block_keys_are_the_same_in_every_process():
    import subprocess
    import sys

    from engine.block_manager import prefix_hashes

    code = ("from engine.block_manager import prefix_hashes; "
            "print(prefix_hashes(list(range(40)), 16))")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip()
    assert other == str(prefix_hashes(list(range(40)), 16))
    assert len(prefix_hashes(list(range(40)), 16)) == 2  # full blocks only


def test_the_published_digest_follows_what_is_cached():
    from engine.block_manager import prefix_hashes

    bm = BlockManager(4, 4)
    a = make_request("a", list(range(100, 109)))
    version = bm.prefix_version
    bm.allocate_slots(a, 9)
    a.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    assert bm.prefix_version != version
    assert bm.published_hashes() == prefix_hashes(a.prompt_token_ids, 4)
    assert bm.published_hashes(limit=1) == prefix_hashes(a.prompt_token_ids, 4)[-1:]
    bm.free(a)
    assert len(bm.published_hashes()) == 2  # cached after free, until evicted
    version = bm.prefix_version
    b = make_request("b", list(range(16)))
    assert bm.allocate_slots(b, 16)  # takes every block: the cached ones are evicted
    assert bm.published_hashes() == [] and bm.prefix_version != version

"""The decode graphs' host block table, kept between steps (engine.decode_block_table): every
row it returns equals its definition, blocks[:count], whatever joined, left, moved row or was
preempted since the call before."""

from __future__ import annotations

import random

import pytest

from engine.block_manager import BlockManager
from engine.decode_block_table import DecodeBlockTable
from engine.request import Request, SamplingParams


def check(table: DecodeBlockTable, rows: list[tuple[list[int], int]]) -> None:
    got = table.update(rows)
    assert got.shape == (len(rows), max(count for _, count in rows))
    for row, (blocks, count) in enumerate(rows):
        assert got[row, :count].tolist() == blocks[:count], f"row {row}"


def test_rows_equal_their_definition_as_requests_join_leave_move_and_grow():
    rng = random.Random(7)
    table = DecodeBlockTable(max_rows=16, max_blocks=40)
    next_id = iter(range(10**6))
    live: list[list[int]] = []  # each running request's block list
    counts: dict[int, int] = {}  # by id(): blocks each reads
    for _ in range(400):
        if len(live) < 16 and rng.random() < 0.3:  # a request starts decoding
            blocks = [next(next_id) for _ in range(rng.randint(1, 8))]
            live.append(blocks)
            counts[id(blocks)] = len(blocks)
        if live and rng.random() < 0.2:  # one finishes: every row after it moves up
            live.pop(rng.randrange(len(live)))
        for blocks in live:  # a block fills now and then; some are held a block ahead
            if rng.random() < 0.2 and counts[id(blocks)] < 39:
                if counts[id(blocks)] == len(blocks):
                    blocks.append(next(next_id))
                counts[id(blocks)] += 1
        if rng.random() < 0.1:
            rng.shuffle(live)  # a different order (shortest-first queues)
        if live and rng.random() < 0.8:  # else an eager step: the table is not asked
            check(table, [(blocks, counts[id(blocks)]) for blocks in live])


def test_a_preempted_request_that_decodes_again_gets_its_new_blocks():
    """Freed and given other blocks, with no graphed step in between (its prompt recomputed in
    eager steps), in the same row and to the same length: the row is not carried over."""
    bm = BlockManager(num_blocks=16, block_size=4)
    a, b, c = (Request(name, list(range(10)), SamplingParams()) for name in "abc")
    for request in (a, b):
        assert bm.allocate_slots(request, 12)
        request.num_computed_tokens = 12
    table = DecodeBlockTable(max_rows=4, max_blocks=8)
    check(table, [(a.block_ids, 3), (b.block_ids, 3)])
    old = list(a.block_ids)
    bm.free(a)  # preempted
    a.num_computed_tokens = 0
    assert bm.allocate_slots(c, 12)  # takes what a let go of
    assert bm.allocate_slots(a, 12)
    assert a.block_ids != old
    check(table, [(a.block_ids, 3), (b.block_ids, 3)])


def test_limits_are_refused_with_the_limit_named():
    table = DecodeBlockTable(max_rows=2, max_blocks=4)
    with pytest.raises(ValueError, match="spans 5 blocks, the graphs hold 4"):
        table.update([(list(range(5)), 5)])
    with pytest.raises(ValueError, match="3 sequences in a step, the graphs hold 2"):
        table.update([([i], 1) for i in range(3)])

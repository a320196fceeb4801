"""The decode graphs' block table on the host, kept from one step to the next.

Why: a decode step's block table holds every running sequence's block ids up to its last
position: at 128 sequences 1,024 tokens deep ~10,700 ints, at 512 blocks each ~65,000. Read
afresh from Python lists, that took ~0.19 ms and ~1.3 ms of host time a step on a 2-core Xeon,
and on a GPU a graphed decode step's host work is what the device waits for at small shapes. A
decoding sequence's blocks only grow (one every block_size steps), so, as vLLM's persistent
batch does, the table is kept: each step carries every sequence's row over from where it sat in
the step before (one numpy gather) and writes only the block ids added since.

A row is carried over only while it mirrors the same list object (a request's `block_ids`, to
which ids are only appended): the block manager gives a request a new list when it frees its
blocks (BlockManager.free), so a preempted request that decodes again, on blocks taken afresh,
gets its row written whole. Between two calls (eager steps in between) rows stay where they were.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# (the block list a row mirrors, its row in the current table, how many ids are written), by
# the list's id(): the entry holds the list, so no other live list can have that id
_Row = tuple[list[int], int, int]


class DecodeBlockTable:
    """Host block table for decode steps of up to `max_rows` sequences of `max_blocks` blocks."""

    def __init__(self, max_rows: int, max_blocks: int):
        self.max_rows, self.max_blocks = max_rows, max_blocks
        # Two tables, each step gathering from the other: a gather in place could read a row
        # that the same gather already overwrote.
        self._tables = (np.zeros((max_rows, max_blocks), np.int32),
                        np.zeros((max_rows, max_blocks), np.int32))
        self._current = 0
        self._rows: dict[int, _Row] = {}

    def update(self, rows: Sequence[tuple[list[int], int]]) -> np.ndarray:
        """This step's table from (block list, count) pairs: row i holds the first count ids of
        its list (columns past that are stale; attention reads none past a sequence's length).
        A view [len(rows), widest] that stays valid until the next call."""
        width = max(count for _, count in rows)
        if width > self.max_blocks:
            raise ValueError(f"a sequence spans {width} blocks, the graphs hold "
                             f"{self.max_blocks}")
        if len(rows) > self.max_rows:
            raise ValueError(f"{len(rows)} sequences in a step, the graphs hold {self.max_rows}")
        previous = self._tables[self._current]
        self._current ^= 1
        table = self._tables[self._current]
        sources, writes, placed = [], [], {}
        for row, (blocks, count) in enumerate(rows):
            key = id(blocks)
            known = self._rows.get(key)
            source, start = row, 0
            if known is not None and known[0] is blocks and known[2] <= count:
                source, start = known[1], known[2]
            sources.append(source)
            if count > start:
                writes.append((row, blocks, start, count))
            placed[key] = (blocks, row, count)
        table[:len(rows), :width] = previous[sources, :width]
        for row, blocks, start, end in writes:
            table[row, start:end] = blocks[start:end]
        self._rows = placed
        return table[:len(rows), :width]

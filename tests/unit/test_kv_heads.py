"""Routing KV heads between caches split over different tensor-parallel sizes (no torch)."""

from __future__ import annotations

import pytest

from kv_transfer.heads import HeadRoute, head_routes


def covered(routes: list[HeadRoute], src: list[range], dst: list[range]) -> dict:
    """(dst buffer, dst head) -> the model head it receives, from each route."""
    got = {}
    for r in routes:
        for k in range(r.count):
            model_head = src[r.src][r.src_start + k]
            assert dst[r.dst][r.dst_start + k] == model_head  # lands where that head lives
            got[(r.dst, r.dst_start + k)] = model_head
    return got


@pytest.mark.parametrize(("src", "dst"), [
    ([range(4)], [range(4)]),  # TP 1 -> TP 1
    ([range(4)], [range(0, 2), range(2, 4)]),  # 1 -> 2: a split
    ([range(0, 2), range(2, 4)], [range(4)]),  # 2 -> 1: a gather
    ([range(0, 1), range(1, 3)], [range(0, 2), range(2, 3)]),  # 3 heads, uneven both sides
    ([range(0, 2), range(2, 4)], [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]),
    ([range(0, 1), range(0, 1), range(1, 2), range(1, 2)], [range(2)]),  # replicated source
    ([range(2)], [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]),  # replicated target
])
def test_every_destination_head_gets_its_own_head_once(src, dst):
    routes = head_routes(src, dst)
    got = covered(routes, src, dst)
    assert sorted(got) == sorted((j, k) for j, heads in enumerate(dst) for k in range(len(heads)))


def test_runs_are_merged_and_a_replicated_head_comes_from_its_first_holder():
    assert head_routes([range(4)], [range(4)]) == [HeadRoute(0, 0, 0, 0, 4)]
    assert head_routes([range(0, 2), range(2, 4)], [range(4)]) == [
        HeadRoute(0, 0, 0, 0, 2), HeadRoute(1, 0, 0, 2, 2)]
    assert head_routes([range(0, 1), range(0, 1)], [range(1)]) == [HeadRoute(0, 0, 0, 0, 1)]


def test_a_head_no_source_holds_is_refused():
    with pytest.raises(ValueError, match="KV head 3 is held by none"):
        head_routes([range(0, 2), range(2, 3)], [range(4)])

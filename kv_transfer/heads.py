"""Which KV heads go where when two caches split the model's KV heads differently (a prefill worker
at one tensor-parallel size, a decode worker at another): each destination buffer gets exactly the
heads it holds, from a source buffer that holds them, in runs of consecutive heads.

Plain Python over ranges: the transports turn each route into one slice copy per block run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadRoute:
    """Heads `src_start..+count` of source buffer `src` are heads `dst_start..+count` of
    destination buffer `dst` (offsets local to each buffer)."""

    src: int
    dst: int
    src_start: int
    dst_start: int
    count: int


def head_routes(src_heads: Sequence[range], dst_heads: Sequence[range]) -> list[HeadRoute]:
    """The routes filling every destination buffer's heads; a head several sources hold (the
    ranks replicate it) is taken from the first. ValueError when no source holds a head."""
    routes: list[HeadRoute] = []
    for dst, heads in enumerate(dst_heads):
        for head in heads:
            src = next((i for i, held in enumerate(src_heads) if head in held), None)
            if src is None:
                raise ValueError(f"KV head {head} is held by none of the source's buffers "
                                 f"({_describe(src_heads)})")
            src_start, dst_start = head - src_heads[src].start, head - heads.start
            last = routes[-1] if routes else None
            if last is not None and (last.src, last.dst) == (src, dst) \
                    and last.src_start + last.count == src_start \
                    and last.dst_start + last.count == dst_start:
                routes[-1] = HeadRoute(src, dst, last.src_start, last.dst_start, last.count + 1)
            else:
                routes.append(HeadRoute(src, dst, src_start, dst_start, 1))
    return routes


def _describe(heads: Sequence[range]) -> str:
    return ", ".join(f"{h.start}..{h.stop - 1}" if len(h) else "none" for h in heads)

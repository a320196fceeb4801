"""A step's ragged batch (engine.step_inputs.host_batch) against its definition, position by
position: decodes with a known or a pending token, prompt chunks that start and end inside
blocks, a chunk whose last token is pending, and prompt-logprob rows."""

from __future__ import annotations

import pickle

from engine.request import Request, SamplingParams
from engine.scheduler import ScheduledRequest
from engine.step_inputs import HostBatch, block_tables, host_batch

BS = 4


def request(name: str, prompt: int, output: int, pending: int, blocks: list[int],
            prompt_logprobs: int | None = None) -> Request:
    r = Request(name, list(range(100, 100 + prompt)),
                SamplingParams(max_tokens=64, prompt_logprobs=prompt_logprobs))
    r.output_token_ids = list(range(500, 500 + output))
    r.num_pending = pending
    r.block_ids = blocks
    return r


class Unpicklable:
    def step(self, token_id: int) -> str:
        return ""

    def __reduce__(self) -> tuple:
        raise TypeError("cannot pickle this (as tokenizers' DecodeStream)")


def item(r: Request, start: int, num: int) -> ScheduledRequest:
    return ScheduledRequest(r, start, num, start + num == r.num_tokens)


def by_definition(items: list[ScheduledRequest]) -> HostBatch:
    """Each position on its own: its token (0 and listed as pending when not known yet), its
    slot in the block that holds it, and the rows whose logits give the next prompt token."""
    batch = HostBatch()
    for it in items:
        r = it.request
        first_row = len(batch.token_ids)
        for pos in range(it.start, it.end):
            if pos < r.num_known_tokens:
                batch.token_ids.append(r.token_at(pos))
            else:
                batch.pending.append((len(batch.token_ids), r.request_id))
                batch.token_ids.append(0)
            batch.positions.append(pos)
            batch.slots.append(r.block_ids[pos // BS] * BS + pos % BS)
        batch.query_lens.append(it.num_tokens)
        batch.seq_lens.append(it.end)
        batch.block_rows.append((r.block_ids, (it.end + BS - 1) // BS))
        if it.samples:
            batch.logits_rows.append(len(batch.token_ids) - 1)
        rows = [first_row + j for j, pos in enumerate(range(it.start, it.end))
                if r.params.prompt_logprobs is not None and pos < r.num_prompt_tokens - 1]
        batch.prompt_counts.append(len(rows))
        batch.prompt_rows.extend(rows)
        batch.prompt_targets.extend(r.prompt_token_ids[it.start + 1 + j]
                                    for j in range(len(rows)))
    return batch


def test_host_batch_matches_its_definition() -> None:
    decode_known = request("a", 6, 3, 0, [7, 2, 9, 13])  # position 8; a block held ahead
    decode_pending = request("b", 5, 2, 1, [4, 11])  # position 7's token is in flight
    chunk_mid = request("c", 13, 0, 0, [20, 3, 21, 5])  # positions 2..10: four blocks
    chunk_pending = request("d", 5, 2, 1, [30, 31])  # recomputed whole, its last token pending
    logprobs = request("e", 9, 0, 0, [40, 41, 42], prompt_logprobs=2)
    items = [item(decode_known, 8, 1), item(decode_pending, 7, 1), item(chunk_mid, 2, 9),
             item(chunk_pending, 0, 8), item(logprobs, 5, 4)]
    assert host_batch(items, BS) == by_definition(items)
    assert host_batch(items, BS).pending == [(1, "b"), (18, "d")]
    # each row up to the block of its last position, a block held ahead left out
    batch = host_batch(items, BS)
    assert block_tables(batch) == [[7, 2, 9], [4, 11], [20, 3, 21], [30, 31], [40, 41, 42]]
    # the rows hold the requests' own lists, not the requests: tensor-parallel ranks get the
    # batch pickled, and a request's detokenizer does not pickle
    assert batch.block_rows[0][0] is decode_known.block_ids
    for it in items:
        it.request.text_stream = Unpicklable()
    assert block_tables(pickle.loads(pickle.dumps(batch))) == block_tables(batch)

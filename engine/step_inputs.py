"""A scheduled step as a ragged batch: host lists first, then the tensors the model reads.

Plain lists are built once per step; the tensors reach the device through pinned memory
(engine.device_tensors). Under async scheduling a request's last token may still be on the
device (sampled by the step before, not read yet): its row gets a placeholder here, listed in
`pending`, and the model runner fills it from that step's sampled tokens on the device.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import AttentionMetadata
from engine.device_tensors import moved, padded_host_tensor, to_device
from engine.scheduler import ScheduledRequest


@dataclass
class HostBatch:
    """A step's ragged batch as host lists, before any tensor is built."""

    token_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    query_lens: list[int] = field(default_factory=list)
    seq_lens: list[int] = field(default_factory=list)
    # Each item's block list (its request's own `block_ids`, not a copy) and how many of its
    # blocks the step reads: its row of the block table is blocks[:count], sliced only where a
    # tensor is built from it (decode graphs keep theirs between steps:
    # engine.decode_block_table). Pickled whole for tensor-parallel ranks.
    block_rows: list[tuple[list[int], int]] = field(default_factory=list)
    logits_rows: list[int] = field(default_factory=list)
    # (row in token_ids, request id) of tokens not read from the device yet
    pending: list[tuple[int, str]] = field(default_factory=list)
    # Prompt logprobs: the rows whose logits give the next prompt token's logprobs, that token,
    # and how many such rows each item has (in item order)
    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    prompt_counts: list[int] = field(default_factory=list)


def host_batch(items: list[ScheduledRequest], block_size: int) -> HostBatch:
    batch = HostBatch()
    for item in items:
        if item.num_tokens == 1:
            _add_decode(batch, item, block_size)
        else:
            _add_chunk(batch, item, block_size)
        if item.samples:
            batch.logits_rows.append(len(batch.token_ids) - 1)
        if item.request.params.prompt_logprobs is None:
            batch.prompt_counts.append(0)
        else:
            _add_prompt_rows(batch, item, len(batch.token_ids) - item.num_tokens)
    return batch


def _add_decode(batch: HostBatch, item: ScheduledRequest, bs: int) -> None:
    """One position: the common case, kept to plain appends (a step has hundreds)."""
    request = item.request
    pos = item.start
    prompt, output = request.prompt_token_ids, request.output_token_ids
    if pos < len(prompt):
        token = prompt[pos]
    elif pos - len(prompt) < len(output):
        token = output[pos - len(prompt)]
    else:  # sampled by the step in flight: only the last token can be pending
        batch.pending.append((len(batch.token_ids), request.request_id))
        token = 0
    blocks = request.block_ids
    batch.token_ids.append(token)
    batch.positions.append(pos)
    batch.slots.append(blocks[pos // bs] * bs + pos % bs)
    batch.query_lens.append(1)
    batch.seq_lens.append(pos + 1)
    batch.block_rows.append((blocks, pos // bs + 1))


def _add_chunk(batch: HostBatch, item: ScheduledRequest, bs: int) -> None:
    """Several positions (a prompt chunk): slots written a block's run at a time."""
    request = item.request
    start, end = item.start, item.end
    known = request.tokens_in(start, min(end, request.num_known_tokens))
    for _ in range(item.num_tokens - len(known)):  # only the last token can be pending
        batch.pending.append((len(batch.token_ids) + len(known), request.request_id))
        known.append(0)
    batch.token_ids.extend(known)
    batch.positions.extend(range(start, end))
    blocks = request.block_ids
    pos = start
    while pos < end:
        stop = min(end, (pos // bs + 1) * bs)
        first = blocks[pos // bs] * bs + pos % bs
        batch.slots.extend(range(first, first + stop - pos))
        pos = stop
    batch.query_lens.append(item.num_tokens)
    batch.seq_lens.append(end)
    batch.block_rows.append((blocks, -(-end // bs)))


def _add_prompt_rows(batch: HostBatch, item: ScheduledRequest, first_row: int) -> None:
    """Rows at prompt positions p < prompt length - 1 predict prompt token p + 1."""
    request = item.request
    end = min(item.end, request.num_prompt_tokens - 1)
    count = max(0, end - item.start)
    batch.prompt_counts.append(count)
    if count:
        batch.prompt_rows.extend(range(first_row, first_row + count))
        batch.prompt_targets.extend(request.prompt_token_ids[item.start + 1:end + 1])


def block_tables(batch: HostBatch) -> list[list[int]]:
    """Each item's row of the block table, as a list."""
    return [blocks[:count] for blocks, count in batch.block_rows]


def batch_tensors(batch: HostBatch, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Token ids, positions and the attention metadata of an eager (not graphed) step."""
    width = max(count for _, count in batch.block_rows)
    table = padded_host_tensor(block_tables(batch), width, torch.int32)
    starts = [0]
    for n in batch.query_lens:
        starts.append(starts[-1] + n)
    md = AttentionMetadata(
        slot_mapping=to_device(batch.slots, torch.int64, device),
        block_table=moved(table, device),
        seq_lens=to_device(batch.seq_lens, torch.int32, device),
        query_start_loc=to_device(starts, torch.int32, device),
        max_query_len=max(batch.query_lens), max_seq_len=max(batch.seq_lens),
        query_lens_list=batch.query_lens, seq_lens_list=batch.seq_lens,
    )
    return (to_device(batch.token_ids, torch.int64, device),
            to_device(batch.positions, torch.int64, device), md)

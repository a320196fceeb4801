"""Decode-only steps replayed from CUDA graphs, one graph per batch-size bucket (vLLM-style).

Why: at decode a step is hundreds of small kernels whose launches cost more host time than the
GPU spends running them (H100, 1B shape: GPU busy 44% of wall, 33,640 launches in 1.6 s). A CUDA
graph replays a whole captured forward with one launch.

How: every input of the captured forward lives in a static buffer sized for the largest bucket
(token ids, positions, slot mapping, block table, sequence lengths; query_start_loc is fixed at
0..n because each sequence has one query). A step of n decodes is padded up to the smallest
bucket b >= n: the padding rows have slot -1 (the KV-write kernel skips them) and sequence
length 0 (attention reads no key for them), and their logits are never read. Each step writes
its rows (and the padding) into the buffers in place, then replays bucket b's graph; the logits
land in the graph's own output tensor. Steps with a prompt chunk, or more decodes than the
largest bucket, run eagerly as before.

Capture-safety: nothing in the captured region reads the device from the host. The Triton
attention kernel would pick its split-KV count from the step's longest sequence, a host value;
here each bucket gets a fixed count (engine.attention.splits, sized for the longest context the
engine allows), passed as `AttentionMetadata.num_kv_splits`. Sampling stays outside the graph,
on the graph's logits.

Without CUDA (tests), `capture=False` runs the same static-buffer forward eagerly: the padding,
the in-place updates and the fixed split counts are then checked against the eager path token
for token under the Triton interpreter; only the capture itself needs a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.attention import AttentionMetadata
from engine.attention.splits import pick_num_splits
from engine.decode_block_table import DecodeBlockTable
from engine.device_tensors import host_tensor
from engine.gc_heap import no_collection

PAD_SLOT = -1  # the KV-write kernels skip negative slots


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to max_num_seqs (and
    max_num_seqs itself), so padding wastes at most 7 rows beyond 8 sequences."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    sizes = {s for s in (1, 2, 4) if s <= max_num_seqs}
    sizes.update(range(8, max_num_seqs + 1, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


def bucket_for(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest size >= num_seqs, or None when the batch is larger than every size."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


@dataclass
class DecodeRows:
    """One decode step as host lists, one entry per sequence (one token each)."""

    token_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    # each sequence's block list (its request's own) and how many of them reach its last
    # position
    block_rows: list[tuple[list[int], int]]

    def padded(self, bucket: int) -> DecodeRows:
        pad = bucket - len(self.token_ids)
        return DecodeRows(self.token_ids + [0] * pad, self.positions + [0] * pad,
                          self.slots + [PAD_SLOT] * pad, self.seq_lens + [0] * pad,
                          self.block_rows)


class StaticDecodeInputs:
    """The buffers a captured decode forward reads; rewritten in place before each replay."""

    def __init__(self, max_seqs: int, max_blocks_per_seq: int, device: torch.device):
        def zeros(*shape: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.token_ids = zeros(max_seqs)
        self.positions = zeros(max_seqs)
        self.slot_mapping = torch.full((max_seqs,), PAD_SLOT, dtype=torch.int64, device=device)
        self.seq_lens = zeros(max_seqs, dtype=torch.int32)
        self.block_table = zeros(max_seqs, max_blocks_per_seq, dtype=torch.int32)
        self.host_block_table = DecodeBlockTable(max_seqs, max_blocks_per_seq)
        self.query_start_loc = torch.arange(max_seqs + 1, dtype=torch.int32, device=device)
        self.rows = torch.arange(max_seqs, dtype=torch.int64, device=device)

    def fill(self, rows: DecodeRows, bucket: int) -> None:
        """Write a step's rows, padded to `bucket`, into the buffers (queued behind the GPU's
        current work: the host copies come from fresh pinned memory). Block-table columns past a
        sequence's length are left stale: attention never reads past seq_lens."""
        padded = rows.padded(bucket)
        self._copy(self.token_ids[:bucket], padded.token_ids, torch.int64)
        self._copy(self.positions[:bucket], padded.positions, torch.int64)
        self._copy(self.slot_mapping[:bucket], padded.slots, torch.int64)
        self._copy(self.seq_lens[:bucket], padded.seq_lens, torch.int32)
        # Kept between steps and rewritten by the next: on CUDA the copy is queued from a pinned
        # copy of it (as every copy here), never from the table itself.
        table = self.host_block_table.update(rows.block_rows)
        self._copy_host(self.block_table[:table.shape[0], :table.shape[1]],
                        torch.from_numpy(np.ascontiguousarray(table)))

    def _copy(self, dst: torch.Tensor, values: list, dtype: torch.dtype) -> None:
        self._copy_host(dst, host_tensor(values, dtype))

    def _copy_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.device.type == "cuda":
            dst.copy_(src.pin_memory(), non_blocking=True)
        else:
            dst.copy_(src)

    def metadata(self, bucket: int, num_kv_splits: int, max_seq_len: int) -> AttentionMetadata:
        """Views of the buffers for `bucket` rows: the same addresses at every replay."""
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bucket], block_table=self.block_table[:bucket],
            seq_lens=self.seq_lens[:bucket], query_start_loc=self.query_start_loc[:bucket + 1],
            max_query_len=1, max_seq_len=max_seq_len,
            query_lens_list=[1] * bucket, seq_lens_list=[max_seq_len] * bucket,
            num_kv_splits=num_kv_splits)


# forward(input_ids, positions, metadata, logits_rows) -> logits [rows, vocab]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor],
                         torch.Tensor]


class DecodeGraphs:
    """Per-bucket decode forwards over StaticDecodeInputs: CUDA graphs when `capture`, else the
    same forwards run eagerly (tests on CPU)."""

    def __init__(self, forward: DecodeForward, max_num_seqs: int, max_model_len: int,
                 block_size: int, num_kv_heads: int, device: torch.device, num_sms: int,
                 capture: bool):
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.forward = forward
        self.sizes = capture_sizes(max_num_seqs)
        self.max_model_len = max_model_len
        self.inputs = StaticDecodeInputs(self.sizes[-1], -(-max_model_len // block_size),
                                         device)
        # Fixed per bucket: sized for the longest context, the count the kernel would pick then.
        self.splits = {b: pick_num_splits(b, num_kv_heads, 1, max_model_len, num_sms)
                       for b in self.sizes}
        self.capture = capture
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays: dict[int, int] = {}  # bucket -> steps that replayed it

    def bucket(self, num_seqs: int) -> int | None:
        return bucket_for(num_seqs, self.sizes)

    def _run_bucket(self, bucket: int) -> torch.Tensor:
        md = self.inputs.metadata(bucket, self.splits[bucket], self.max_model_len)
        return self.forward(self.inputs.token_ids[:bucket], self.inputs.positions[:bucket], md,
                            self.inputs.rows[:bucket])

    def capture_all(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool. The
        buffers hold padding only (slot -1, length 0): capture writes no KV."""
        if not self.capture:
            return
        pool = None
        with no_collection():  # engine.gc_heap: a collection mid-capture can break it
            for bucket in reversed(self.sizes):
                self._run_bucket(bucket)  # compiles kernels, sets up cuBLAS outside the capture
                torch.cuda.synchronize(self.inputs.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self._outputs[bucket] = self._run_bucket(bucket)
                pool = graph.pool()
                self._graphs[bucket] = graph
        torch.cuda.synchronize(self.inputs.device)

    def prepare(self, rows: DecodeRows, bucket: int) -> None:
        """Write a step's rows into the static buffers (host-side step preparation)."""
        self.inputs.fill(rows, bucket)

    def replay(self, bucket: int) -> torch.Tensor:
        """Logits [bucket, vocab] of the prepared step (rows past its sequences are padding).
        The tensor is the graph's own output: read it before the next step."""
        self.replays[bucket] = self.replays.get(bucket, 0) + 1
        if not self.capture:
            return self._run_bucket(bucket)
        self._graphs[bucket].replay()
        return self._outputs[bucket]

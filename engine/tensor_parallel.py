"""Tensor parallelism inside one engine: what each rank holds and the collectives the model calls.

Megatron-style: q/k/v and gate/up are split by output rows (column-parallel), o and down by input
columns (row-parallel: their partial products are summed by one all-reduce after attention and one
after the MLP), the embedding and the LM head by vocabulary rows (a masked lookup summed by an
all-reduce; the logits gathered). Attention heads are split by KV-head group, so every rank's query
heads attend its own KV heads: with more KV heads than ranks each rank takes a contiguous range of
them (uneven where they do not divide: 3 KV heads over 2 ranks are 1 + 2), with fewer each KV head
is replicated on the ranks that share its query heads.

The group is a standalone gloo (CPU) or NCCL (CUDA) process group over its own TCP store, not
torch.distributed's default group (the dist KV transport makes its own pair groups beside it);
every collective waits at most the group's timeout."""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 120.0  # a rank that stops answering fails the step, never hangs it


def split(n: int, rank: int, size: int) -> range:
    """Rank `rank`'s contiguous share of `n` items over `size` ranks (the last ones larger:
    rank 0 also samples)."""
    return range(n * rank // size, n * (rank + 1) // size) if n >= size else range(0)


@dataclass(frozen=True)
class ShardPlan:
    """What one rank of `size` holds of a model (ValueError when the model cannot be split)."""

    rank: int
    size: int
    q_heads: range
    kv_heads: range
    intermediate: range
    vocab: range  # rows of the embedding and LM head (padded: every rank's is vocab_shard long)
    vocab_shard: int

    @classmethod
    def of(cls, num_heads: int, num_kv_heads: int, intermediate_size: int, vocab_size: int,
           rank: int, size: int) -> ShardPlan:
        if size < 1 or not 0 <= rank < size:
            raise ValueError(f"rank {rank} of {size} ranks")
        group = num_heads // num_kv_heads  # query heads per KV head
        if num_kv_heads >= size:
            kv = split(num_kv_heads, rank, size)
            q = range(kv.start * group, kv.stop * group)
        else:
            if size % num_kv_heads or group % (size // num_kv_heads):
                raise ValueError(
                    f"tensor_parallel_size {size} cannot split {num_heads} query heads over "
                    f"{num_kv_heads} KV heads: with fewer KV heads than ranks, the ranks must be "
                    f"a multiple of the KV heads and divide each KV head's {group} query heads")
            sharing = size // num_kv_heads  # ranks per KV head
            kv_head = rank // sharing
            per_rank = group // sharing
            first = kv_head * group + (rank % sharing) * per_rank
            kv, q = range(kv_head, kv_head + 1), range(first, first + per_rank)
        if intermediate_size < size:
            raise ValueError(f"intermediate_size {intermediate_size} < tensor_parallel_size "
                             f"{size}")
        shard = -(-vocab_size // size)
        vocab = range(min(rank * shard, vocab_size), min((rank + 1) * shard, vocab_size))
        return cls(rank, size, q, kv, split(intermediate_size, rank, size), vocab, shard)


class TPGroup:
    """This rank's view of the group; with `size` 1 every collective is a no-op."""

    def __init__(self, rank: int, size: int, group: dist.ProcessGroup | None = None):
        self.rank = rank
        self.size = size
        self.group = group

    @classmethod
    def join(cls, store: dist.Store, rank: int, size: int, device: torch.device,
             timeout_s: float = COLLECTIVE_TIMEOUT_S) -> TPGroup:
        """Rendezvous with the other ranks through `store` (each calls this with its rank)."""
        prefix = dist.PrefixStore("tensor-parallel", store)
        timeout = datetime.timedelta(seconds=timeout_s)
        if device.type == "cuda":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            group: dist.ProcessGroup = dist.ProcessGroupNCCL(prefix, rank, size, options)
        else:
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
            group = dist.ProcessGroupGloo(prefix, rank, size, options)
        return cls(rank, size, group)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place."""
        if self.group is not None and self.size > 1:
            self.group.allreduce([tensor]).wait()
        return tensor

    def gather_columns(self, tensor: torch.Tensor, total: int) -> torch.Tensor:
        """Every rank's [rows, shard] concatenated along the last dim, cut to `total` columns."""
        if self.group is None or self.size == 1:
            return tensor[..., :total]
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return torch.cat(parts, dim=-1)[..., :total]

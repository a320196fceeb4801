"""The ranks of a tensor-parallel engine beyond rank 0: one process each, holding its share of the
weights and its heads' KV cache, running the model on every step rank 0 runs.

Rank 0 (the engine's process: scheduler, block manager, sampling) starts them, hands each step's
batch to them over a pipe (host lists: each rank builds its own tensors), and runs its own share
of the forward; the ranks meet in the forward's collectives (engine.tensor_parallel). A rank that
dies fails the step that needs it (its peers' collectives error or time out), and rank 0's next
step refuses to run: the engine goes down as a unit. A rank whose parent is gone exits."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle, send_handle

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.kv_memory import KVBuffer, map_kv_buffer
from engine.tensor_parallel import COLLECTIVE_TIMEOUT_S, ShardPlan, TPGroup

log = logging.getLogger(__name__)
START_TIMEOUT_S = 300.0  # a rank's start: import, rendezvous, weights
POLL_S = 1.0  # how often an idle rank checks that rank 0 is still there


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its share of the model and cache."""

    model_path: str
    model_config: ModelConfig
    dtype: torch.dtype
    device: str
    block_size: int
    num_blocks: int
    attention_backend: str
    max_positions: int
    size: int
    store_port: int
    threads: int


class TensorParallelRanks:
    """Rank 0's handle on ranks 1..size-1. On CPU each rank's KV cache lives in a memfd that
    rank 0 maps too (`kv_buffers`): the KV transports read and write every rank's heads from
    rank 0's process, as they do a single-rank cache."""

    def __init__(self, spec: RankSpec, store: dist.TCPStore):
        self._store = store  # the group's rendezvous: kept while the group lives
        self._broken: str | None = None
        context = mp.get_context("spawn")
        self._conns: list[Connection] = []
        self._procs: list[mp.process.BaseProcess] = []
        self.kv_buffers: list[KVBuffer] = []  # ranks 1.. (CPU): their caches, mapped here
        for rank in range(1, spec.size):
            ours, theirs = context.Pipe()
            proc = context.Process(target=rank_main, args=(spec, rank, theirs, os.getpid()),
                                   name=f"tp-rank-{rank}", daemon=True)
            proc.start()
            theirs.close()
            self._conns.append(ours)
            self._procs.append(proc)
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs)
        self.group = TPGroup.join(store, 0, spec.size, torch.device(spec.device))
        for rank, conn in enumerate(self._conns, start=1):
            self._expect_ready(rank, conn, spec)

    def _expect_ready(self, rank: int, conn: Connection, spec: RankSpec) -> None:
        if not conn.poll(START_TIMEOUT_S):
            self.close()
            raise RuntimeError(f"tensor-parallel rank {rank} did not start within "
                               f"{START_TIMEOUT_S:.0f}s")
        answer = conn.recv()
        if answer != "ready":
            self.close()
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {answer}")
        if torch.device(spec.device).type == "cpu":
            try:
                fd = recv_handle(conn)
                self.kv_buffers.append(map_kv_buffer(fd, rank_cache_shape(spec, rank),
                                                     spec.dtype))
            except (OSError, ValueError) as exc:
                self.close()
                raise RuntimeError(f"mapping tensor-parallel rank {rank}'s KV cache: "
                                   f"{exc}") from exc

    def break_off(self, reason: str) -> None:
        """The group can no longer run in step: stop the ranks, and say why from now on."""
        self._broken = reason
        self.close()

    def lost(self) -> str | None:
        """Why the group cannot run any more (a rank is gone), or None."""
        if self._broken is not None:
            return self._broken
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if not proc.is_alive():
                return f"tensor-parallel rank {rank} is gone ({_last_word(conn, proc)})"
        return None

    def send(self, message: tuple) -> None:
        """Hand every rank the same command ("step", batch, rows) or ("copy", pairs)."""
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken ({self._broken})")
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if not proc.is_alive() or conn.poll():  # dead, or it reported an error and left
                raise RuntimeError(f"tensor-parallel rank {rank} is gone "
                                   f"({_last_word(conn, proc)}): the engine cannot run without it")
            conn.send(message)

    def close(self) -> None:
        self._finalizer()


def _last_word(conn: Connection, proc: mp.process.BaseProcess) -> str:
    """What a rank that left said (its error), else how it ended."""
    try:
        if conn.poll():
            return str(conn.recv())
    except (EOFError, OSError):
        pass
    proc.join(1.0)
    return f"exit code {proc.exitcode}"


def _stop(conns: list[Connection], procs: list[mp.process.BaseProcess]) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.join(10.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)


def start_ranks(spec: RankSpec) -> TensorParallelRanks:
    """Host the group's store, start ranks 1..size-1 and join them as rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    return TensorParallelRanks(dataclasses.replace(spec, store_port=store.port), store)


def rank_main(spec: RankSpec, rank: int, conn: Connection, parent: int) -> None:
    """A rank's process: build its share, then run every step rank 0 sends until told to stop."""
    torch.set_num_threads(spec.threads)
    try:
        store = dist.TCPStore("127.0.0.1", spec.store_port, is_master=False,
                              wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
        group = TPGroup.join(store, rank, spec.size, torch.device(spec.device),
                             COLLECTIVE_TIMEOUT_S)
        shard = RankShard(spec, rank, group)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails its start
        conn.send(f"{type(exc).__name__}: {exc}")
        return
    conn.send("ready")
    if shard.kv.fd is not None:  # rank 0 maps our cache (its transports move our heads)
        send_handle(conn, shard.kv.fd, parent)
    while True:
        if not conn.poll(POLL_S):
            if os.getppid() != parent:  # rank 0 is gone
                return
            continue
        message = conn.recv()
        if message[0] == "stop":
            return
        try:
            shard.run(message)
        except Exception as exc:  # noqa: BLE001 - rank 0 learns it at its next step
            log.exception("tensor-parallel rank %d failed", rank)
            conn.send(f"{type(exc).__name__}: {exc}")
            return


class RankShard:
    """One rank's model share, KV cache and attention backend."""

    def __init__(self, spec: RankSpec, rank: int, group: TPGroup):
        from pathlib import Path

        from engine.attention import get_attention_backend
        from engine.kv_memory import allocate_kv_buffer
        from engine.loader import load_weights
        from engine.models.llama import LlamaModel

        config = spec.model_config
        self.device = torch.device(spec.device)
        self.block_size = spec.block_size
        shard = shard_of(config, rank, spec.size)
        weights = load_weights(Path(spec.model_path), config, spec.dtype, self.device, shard)
        self.model = LlamaModel(config, weights, spec.max_positions, tp=group, shard=shard)
        self.kv = allocate_kv_buffer(rank_cache_shape(spec, rank), spec.dtype, self.device,
                                     shareable=True)
        self.attention = get_attention_backend(spec.attention_backend, self.device)

    def run(self, message: tuple) -> None:
        from engine.step_inputs import batch_tensors

        if message[0] == "copy":
            copy_blocks(self.kv.tensor, message[1], self.device)
            return
        _, batch, rows = message
        input_ids, positions, md = batch_tensors(batch, self.device)
        self.attention.prepare(md.block_table, md.query_lens_list, md.seq_lens_list,
                               self.block_size)
        self.model.forward(input_ids, positions, self.kv.layers, md, self.attention,
                           torch.tensor(rows, dtype=torch.int64, device=self.device))


def rank_cache_shape(spec: RankSpec, rank: int) -> tuple[int, ...]:
    config = spec.model_config
    heads = len(shard_of(config, rank, spec.size).kv_heads)
    return (config.num_layers, 2, spec.num_blocks, spec.block_size, heads, config.head_dim)


def shard_of(config: ModelConfig, rank: int, size: int) -> ShardPlan:
    return ShardPlan.of(config.num_heads, config.num_kv_heads, config.intermediate_size,
                        config.vocab_size, rank, size)


def copy_blocks(cache: torch.Tensor, copies: list[tuple[int, int]], device: torch.device
                ) -> None:
    """Whole KV blocks (source, destination) in every layer of a [layers, 2, blocks, ...] cache."""
    src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=device)
    dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=device)
    cache.index_copy_(2, dst, cache.index_select(2, src))

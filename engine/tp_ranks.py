"""The ranks of a tensor-parallel engine beyond rank 0: one process each, holding its share of the
weights and its heads' KV cache, running the model on every step rank 0 runs.

Rank 0 (the engine's process: scheduler, block manager, sampling) starts them — as local
processes, or through another launcher (deploy/'s Ray actors in the worker's placement group) —
and they connect back to its Unix socket (an abstract name, a random key both sides prove), which
carries each step's batch to them (host lists: each rank builds its own tensors) and, on CPU, each
rank's KV-cache memfd to rank 0, which maps it for the KV transports. Rank 0 runs its own share of
the forward; the ranks meet in the forward's collectives (engine.tensor_parallel). A rank that
dies fails the step that needs it (its peers' collectives error or time out), and rank 0's next
step refuses to run: the engine goes down as a unit. A rank whose rank 0 is gone exits."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import multiprocessing as mp
import os
import secrets
import socket
import struct
import time
import weakref
from dataclasses import dataclass
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, answer_challenge, deliver_challenge
from multiprocessing.reduction import recv_handle, send_handle
from typing import Protocol

import torch
import torch.distributed as dist

from engine.config import ModelConfig
from engine.gc_heap import freeze_startup_heap, thaw_heap
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


class RankProcess(Protocol):
    """Rank 0's handle on where one rank runs."""

    def alive(self) -> bool: ...

    def describe(self) -> str:
        """How it ended, for error messages."""
        ...

    def stop(self, timeout_s: float) -> None:
        """Make sure it is gone (after it was told to stop)."""
        ...


class RankLauncher(Protocol):
    def start(self, spec: RankSpec, rank: int, address: str, authkey: bytes) -> RankProcess:
        """Run `rank_main(spec, rank, address, authkey)` somewhere on this host."""
        ...


class LocalRank:
    def __init__(self, proc: mp.process.BaseProcess):
        self.proc = proc

    def alive(self) -> bool:
        return self.proc.is_alive()

    def describe(self) -> str:
        self.proc.join(1.0)
        return f"exit code {self.proc.exitcode}"

    def stop(self, timeout_s: float) -> None:
        self.proc.join(timeout_s)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


class ProcessLauncher:
    """Each rank a spawned child process of rank 0's."""

    def start(self, spec: RankSpec, rank: int, address: str, authkey: bytes) -> LocalRank:
        proc = mp.get_context("spawn").Process(
            target=rank_main, args=(spec, rank, address, authkey, os.getpid()),
            name=f"tp-rank-{rank}", daemon=True)
        proc.start()
        return LocalRank(proc)


class TensorParallelRanks:
    """Rank 0's handle on ranks 1..size-1. On CPU each rank's KV cache lives in a memfd that
    rank 0 maps too (`kv_buffers`): the KV transports read and write every rank's heads from
    rank 0's process, as they do a single-rank cache."""

    def __init__(self, spec: RankSpec, store: dist.TCPStore, launcher: RankLauncher):
        self._store = store  # the group's rendezvous: kept while the group lives
        self._broken: str | None = None
        self.size = spec.size
        self.kv_buffers: list[KVBuffer] = []  # ranks 1.. (CPU): their caches, mapped here
        self._conns: list[Connection] = []
        self._procs: list[RankProcess] = []
        self._finalizer = weakref.finalize(self, _stop, self._conns, self._procs,
                                           self.kv_buffers)
        try:
            authkey = secrets.token_bytes(32)
            with _listening() as (listener, address):
                for rank in range(1, spec.size):
                    self._procs.append(launcher.start(spec, rank, address, authkey))
                self._conns.extend(self._accept_all(listener, authkey, spec.size))
            self.group = TPGroup.join(store, 0, spec.size, torch.device(spec.device))
            for rank, conn in enumerate(self._conns, start=1):
                self._expect_ready(rank, conn, spec)
        except BaseException:
            self.close()  # every rank started so far, and every cache mapped
            raise

    def _accept_all(self, listener: socket.socket, authkey: bytes, size: int
                    ) -> list[Connection]:
        """Every rank's connection, in rank order (they connect in any). A connection that
        fails the handshake (another user, a wrong key, a bad or repeated rank, silence) is
        dropped and the wait goes on; a rank that ends first fails the start."""
        by_rank: dict[int, Connection] = {}
        deadline = time.monotonic() + START_TIMEOUT_S
        while len(by_rank) < size - 1:
            gone = [r for r, p in enumerate(self._procs, start=1) if not p.alive()]
            if gone:
                raise RuntimeError(f"tensor-parallel rank {gone[0]} ended before it joined "
                                   f"({self._procs[gone[0] - 1].describe()})")
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every tensor-parallel rank joined within "
                                   f"{START_TIMEOUT_S:.0f}s")
            try:
                sock, _ = listener.accept()
            except TimeoutError:
                continue
            try:
                rank, conn = _handshake(sock, authkey, size)
            except (OSError, EOFError, ValueError, AuthenticationError) as exc:
                log.warning("refused a connection to the tensor-parallel group: %s", exc)
                continue
            if rank in by_rank:
                conn.close()
                log.warning("refused a second connection claiming rank %d", rank)
                continue
            by_rank[rank] = conn
        return [by_rank[rank] for rank in range(1, size)]

    def _expect_ready(self, rank: int, conn: Connection, spec: RankSpec) -> None:
        if not conn.poll(START_TIMEOUT_S):
            raise RuntimeError(f"tensor-parallel rank {rank} did not start within "
                               f"{START_TIMEOUT_S:.0f}s")
        answer = _receive(conn)
        if answer != "ready":
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {answer}")
        if torch.device(spec.device).type == "cpu":
            try:
                fd = recv_handle(conn)
                self.kv_buffers.append(map_kv_buffer(fd, rank_cache_shape(spec, rank),
                                                     spec.dtype))
            except (OSError, ValueError, EOFError, RuntimeError) as exc:
                raise RuntimeError(f"mapping tensor-parallel rank {rank}'s KV cache: "
                                   f"{exc}") from exc

    def break_off(self, reason: str) -> None:
        """The group can no longer run in step: stop the ranks, and say why from now on."""
        self._broken = reason
        self.close()

    def lost(self) -> str | None:
        """Why the group cannot run any more (a rank is gone or left with an error), or None."""
        if self._broken is not None:
            return self._broken
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if not proc.alive() or conn.poll():  # a rank only speaks up to say why it left
                return f"tensor-parallel rank {rank} is gone ({_last_word(conn, proc)})"
        return None

    def send(self, message: tuple) -> None:
        """Hand every rank the same command ("step", batch, rows) or ("copy", pairs)."""
        if self._broken is not None:
            raise RuntimeError(f"the tensor-parallel group is broken ({self._broken})")
        for rank, (conn, proc) in enumerate(zip(self._conns, self._procs), start=1):
            if not proc.alive() or conn.poll():  # dead, or it reported an error and left
                raise RuntimeError(f"tensor-parallel rank {rank} is gone "
                                   f"({_last_word(conn, proc)}): the engine cannot run without it")
            conn.send(message)

    def close(self) -> None:
        self._finalizer()


class _listening:
    """A Unix socket under a random abstract name (nothing on disk), for the ranks to join."""

    def __enter__(self) -> tuple[socket.socket, str]:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = f"\0pdserve-tp-{os.getpid()}-{secrets.token_hex(8)}"
        self.sock.bind(address)
        self.sock.listen(64)
        self.sock.settimeout(POLL_S)
        return self.sock, address

    def __exit__(self, *_: object) -> None:
        self.sock.close()


HANDSHAKE_TIMEOUT_S = 10.0


def _handshake(sock: socket.socket, authkey: bytes, size: int) -> tuple[int, Connection]:
    """A joining rank's connection: the same user, the group's key both ways, then its rank
    (1..size-1); every read bounded (the socket stays blocking for Connection, with a receive
    timeout that is lifted once it is in)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    if uid != os.getuid():
        sock.close()
        raise ValueError(f"a process of uid {uid}, not {os.getuid()}")
    sock.settimeout(None)
    bounded = struct.pack("ll", int(HANDSHAKE_TIMEOUT_S), 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, bounded)
    conn = Connection(sock.detach())
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
        hello = conn.recv()
        if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "hello"
                and isinstance(hello[1], int) and 1 <= hello[1] < size):
            raise ValueError(f"not a rank's hello: {hello!r:.80}")
        unbounded = socket.socket(fileno=os.dup(conn.fileno()))
        unbounded.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        unbounded.close()
    except BaseException:
        conn.close()
        raise
    return hello[1], conn


def _receive(conn: Connection) -> object:
    try:
        return conn.recv()
    except (EOFError, OSError) as exc:
        return f"its connection closed ({exc or type(exc).__name__})"


def _last_word(conn: Connection, proc: RankProcess) -> str:
    """What a rank that left said (its error), else how it ended."""
    try:
        if conn.poll():
            return str(conn.recv())
    except (EOFError, OSError):
        pass
    return proc.describe()


def _stop(conns: list[Connection], procs: list[RankProcess], buffers: list[KVBuffer]) -> None:
    for conn in conns:
        try:
            conn.send(("stop",))
        except (OSError, ValueError):
            pass
    for proc in procs:
        proc.stop(10.0)
    for conn in conns:
        conn.close()
    for buffer in buffers:  # the ranks' memfds: their memory goes once nothing maps it
        buffer.release()


def start_ranks(spec: RankSpec, launcher: RankLauncher | None = None) -> TensorParallelRanks:
    """Host the group's store, start ranks 1..size-1 (local processes unless `launcher` says
    otherwise) and join them as rank 0."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=START_TIMEOUT_S))
    return TensorParallelRanks(dataclasses.replace(spec, store_port=store.port), store,
                               launcher or ProcessLauncher())


def rank_main(spec: RankSpec, rank: int, address: str, authkey: bytes,
              parent: int | None = None) -> None:
    """A rank: join rank 0 at `address`, build its share, then run every step rank 0 sends
    until told to stop or rank 0 is gone (its connection closed, or `parent` no longer ours)."""
    torch.set_num_threads(spec.threads)
    conn = Client(address, family="AF_UNIX", authkey=authkey)
    conn.send(("hello", rank))
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
        send_handle(conn, shard.kv.fd, 0)
    # This process (or Ray actor) runs this rank's steps until it ends, and a full collection
    # here would stall every rank at the next collective (engine.gc_heap).
    freeze_startup_heap()
    try:
        serve_steps(shard, rank, conn, parent)
    finally:
        thaw_heap()


def serve_steps(shard: RankShard, rank: int, conn: Connection, parent: int | None) -> None:
    while True:
        if not conn.poll(POLL_S):
            if parent is not None and os.getppid() != parent:  # rank 0 is gone
                return
            continue
        try:
            message = conn.recv()
        except (EOFError, OSError):  # rank 0 is gone
            return
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

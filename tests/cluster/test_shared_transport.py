"""The shared transport between real processes: a decode-side process exports its cache (a memfd
over a Unix socket), a prefill-side process maps it once and copies blocks straight into the
destination ids. A writer killed mid-write closes its mapping (the exporter learns it), and a
writer whose peer died fails cleanly without writing."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import socket
import threading

import pytest
import torch

from engine.kv_memory import KVShards, allocate_kv_buffer
from kv_transfer.shared.copy import block_runs, copy_blocks
from kv_transfer.shared.exporter import KVExporter
from kv_transfer.shared.mapping import _recv_header, recv_frame, send_frame
from tests.cluster import shared_peers

pytestmark = pytest.mark.slow


def start_exporter():
    ctx = mp.get_context("spawn")
    queue, commands = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=shared_peers.exporter, args=(queue, commands), daemon=True)
    proc.start()
    kind, address = queue.get(timeout=60)
    assert kind == "address" and address.startswith("@pdserve-kv-decode-t-")
    return ctx, proc, queue, commands, address


def test_block_runs_and_copy_between_caches():
    assert block_runs([3, 4, 5, 9, 1], [10, 11, 12, 2, 0]) == [(3, 10, 3), (9, 2, 1), (1, 0, 1)]
    assert block_runs([], []) == []
    with pytest.raises(ValueError):
        block_runs([1], [1, 2])
    src = shared_peers.source_cache()
    dst = torch.zeros_like(src)
    n = copy_blocks(shared_peers.as_shards(src), shared_peers.SRC_BLOCKS,
                    shared_peers.as_shards(dst), shared_peers.DST_BLOCKS)
    assert torch.equal(dst[:, :, shared_peers.DST_BLOCKS], shared_peers.expected_blocks())
    assert n == 5 * src[:, :, 0].numel() * 4


def blocks_then_stop(proc, queue, commands) -> tuple[torch.Tensor, bool]:  # noqa: ANN001
    """The exporter's blocks at DST_BLOCKS and whether every other block is still zero; then
    the exporter stops."""
    commands.put("check")
    kind, blocks, rest_zero = queue.get(timeout=30)
    assert kind == "blocks"
    commands.put("stop")
    proc.join(30)
    return blocks, rest_zero


def events(queue, n: int) -> list[tuple]:
    return [queue.get(timeout=60) for _ in range(n)]


def test_blocks_land_at_the_receivers_ids_and_nowhere_else():
    ctx, proc, queue, commands, address = start_exporter()
    writer = ctx.Process(target=shared_peers.writer,
                         args=(address, queue, ["write", "refused", "write"]))
    writer.start()
    got = events(queue, 8)
    writer.join(30)
    # Each process's events arrive in its own order (the two interleave freely).
    exporter_side = [e for e in got if e[0] in ("began", "finished", "gone")]
    writer_side = [e for e in got if e[0] in ("sent", "error")]
    assert [e[0] for e in exporter_side] == ["began", "finished", "began", "finished", "gone"]
    assert [e[0] for e in writer_side] == ["sent", "error", "sent"]
    writers = {e[1] for e in exporter_side}
    assert len(writers) == 1, f"the cache was mapped more than once: {writers}"
    refused = writer_side[1]
    assert "refused begin" in refused[1] and not refused[2]  # not permanent: the pair is fine
    assert all(e[2] == "shared" for e in writer_side if e[0] == "sent")
    blocks, rest_zero = blocks_then_stop(proc, queue, commands)
    assert torch.equal(blocks, shared_peers.expected_blocks())
    assert rest_zero, "a block outside the destination ids was written"


def test_writes_in_pieces_interleave_through_one_mapping_and_land_whole():
    """KV streaming's use of the transport: several requests' writes open at once, each filled
    by several copies, finishing in any order."""
    ctx, proc, queue, commands, address = start_exporter()
    writer = ctx.Process(target=shared_peers.writer, args=(address, queue, ["interleaved"]))
    writer.start()
    got = events(queue, 7)
    writer.join(30)
    exporter_side = [e for e in got if e[0] in ("began", "finished", "gone")]
    assert [e[0] for e in exporter_side] == ["began", "began", "finished", "finished", "gone"]
    assert [e[2] for e in exporter_side[:2]] == ["a", "b"]
    block = shared_peers.source_cache()[:, :, 0].numel() * 4
    assert [e[3] for e in exporter_side[2:4]] == [2 * block, 3 * block]  # b, then a
    assert [e[1] for e in got if e[0] == "sent"] == [2 * block, 3 * block]
    blocks, rest_zero = blocks_then_stop(proc, queue, commands)
    assert torch.equal(blocks, shared_peers.expected_blocks())
    assert rest_zero, "a block outside the destination ids was written"


def test_a_writer_without_the_transfer_secret_is_refused_and_writes_nothing():
    ctx, proc, queue, commands, address = start_exporter()
    writer = ctx.Process(target=shared_peers.writer, args=(address, queue, ["wrong-secret"]))
    writer.start()
    got = events(queue, 2)
    writer.join(30)
    # Never began: no write was admitted. The writer's "error" and the exporter's "gone" come
    # from two processes, so either may reach the queue first.
    assert sorted(e[0] for e in got) == ["error", "gone"]
    error = next(e for e in got if e[0] == "error")
    assert "wrong transfer secret" in error[1] and not error[2]
    blocks, rest_zero = blocks_then_stop(proc, queue, commands)
    assert not blocks.any() and rest_zero, "a refused writer wrote"


def test_a_writer_killed_mid_write_closes_its_mapping_once_it_has_exited():
    ctx, proc, queue, commands, address = start_exporter()
    writer = ctx.Process(target=shared_peers.writer, args=(address, queue, ["hang"]))
    writer.start()
    kind, key, _ = queue.get(timeout=60)
    assert kind == "began"
    os.kill(writer.pid, signal.SIGKILL)
    writer.join(30)
    assert queue.get(timeout=30) == ("gone", key)
    commands.put("stop")
    proc.join(30)


def test_a_dead_exporter_fails_the_next_write_without_writing():
    ctx, proc, queue, commands, address = start_exporter()
    commands.put("stop")  # the decode side goes away before the prefill side maps it
    proc.join(30)
    writer = ctx.Process(target=shared_peers.writer, args=(address, queue, ["write"]))
    writer.start()
    kind, message, permanent = queue.get(timeout=60)
    writer.join(30)
    assert kind == "error" and "cannot map" in message and permanent


def test_a_writer_counts_as_dead_once_it_has_finished_exiting():
    import subprocess
    import sys
    import time

    from kv_transfer.shared.mapping import wait_until_dead

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    started = time.monotonic()
    assert not wait_until_dead(child.pid, 0.3)  # alive: the whole grace, then False
    assert time.monotonic() - started >= 0.3
    child.kill()
    assert wait_until_dead(child.pid, 10.0)  # a zombie (not reaped yet) has released everything
    child.wait()
    assert wait_until_dead(child.pid, 10.0)  # gone


def test_a_silent_export_times_out_as_a_transient_failure():
    """An export that accepts but never answers (a decode worker too busy to reply): the
    handshake times out — worth another try later, not a broken pair."""
    import socket

    from kv_transfer.errors import TransferError
    from kv_transfer.shared.sender import SharedSender

    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.bind("\0pdserve-kv-silent-test")
    silent.listen(1)
    try:
        sender = SharedSender("prefill-t", timeout_s=0.5)
        with pytest.raises(TransferError) as failed:
            sender.send("decode-s", "@pdserve-kv-silent-test", "r1",
                        shared_peers.as_shards(shared_peers.source_cache()), [0], [0])
        assert not failed.value.permanent and "cannot map" in str(failed.value)
    finally:
        silent.close()


@pytest.mark.parametrize("frame", [
    b"[1, 2]", b"null",
    b'{"op": "begin", "request_id": "r", "num_blocks": null, "dtype": "float32"}'])
def test_a_frame_of_the_wrong_shape_still_ends_its_mappings_writes(frame):
    """A writer's frame that is JSON of the wrong shape used to end the mapping's thread with
    an uncaught error: the writes of that mapping were never ended, their reservations held for
    good. Now the mapping ends them once its writer is gone."""
    gone = threading.Event()

    class Book:
        def admit(self, write: object) -> list[int]:
            raise AssertionError("a write of no block count was admitted")

        def writer_gone(self, writer: str) -> None:
            gone.set()

    buffer = allocate_kv_buffer(shared_peers.SHAPE, torch.float32, torch.device("cpu"),
                                shareable=True)
    exporter = KVExporter("decode-u", KVShards.whole(buffer), Book())  # type: ignore[arg-type]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect("\0" + exporter.address.removeprefix("@"))
            send_frame(conn, json.dumps({"writer": "w"}).encode())
            _, fds = _recv_header(conn)  # the cache: mapped by a real writer, not here
            for fd in fds:
                os.close(fd)
            send_frame(conn, frame)
            if b"begin" in frame:  # a bad field: answered, and the mapping goes on
                assert "error" in json.loads(recv_frame(conn))
        assert gone.wait(10), "the mapping's writes were never ended"
    finally:
        exporter.close()

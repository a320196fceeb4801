"""One request's KV pieces over the dist transport, sent in order on a thread of their own (the
engine loop packs each piece between steps and never waits for a send)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence

import torch

from engine.omp_threads import use_one_torch_thread
from kv_transfer.errors import TransferError

# send(layers, first_block, num_blocks): one piece, acknowledged by the decode worker on return.
SendPiece = Callable[[Sequence[torch.Tensor], int, int], object]


class PieceSender:
    def __init__(self, request_id: str, send: SendPiece):
        self.request_id = request_id
        self._send = send
        self._queue: queue.SimpleQueue[tuple | None] = queue.SimpleQueue()
        self._pending = 0
        self._cancelled = False
        self._cond = threading.Condition()
        self.error: TransferError | None = None  # the first piece that failed (later ones skipped)
        threading.Thread(target=self._run, name=f"kv-pieces-{request_id}", daemon=True).start()

    def put(self, layers: Sequence[torch.Tensor], first_block: int, num_blocks: int) -> None:
        with self._cond:
            self._pending += 1
        self._queue.put((layers, first_block, num_blocks))

    def _run(self) -> None:
        use_one_torch_thread()  # packing and sending never start an OpenMP team here
        while (item := self._queue.get()) is not None:
            try:
                if self.error is None and not self._cancelled:
                    self._send(*item)
            except TransferError as exc:
                self.error = exc
            except Exception as exc:  # noqa: BLE001 - any failure ends the stream
                self.error = TransferError(f"sending a KV piece of {self.request_id}: {exc}")
            finally:
                with self._cond:
                    self._pending -= 1
                    self._cond.notify_all()

    def drain(self, timeout_s: float) -> None:
        """Wait until every piece put so far is acknowledged (TransferError if one failed or
        they take longer than `timeout_s`)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._pending == 0, timeout_s):
                raise TransferError(f"KV pieces of {self.request_id} still unsent after "
                                    f"{timeout_s:.0f}s")
        if self.error is not None:
            raise self.error

    def close(self, cancel: bool = False) -> None:
        """No more pieces; with `cancel`, those not yet sent are dropped."""
        self._cancelled = self._cancelled or cancel
        self._queue.put(None)

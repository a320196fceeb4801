"""A request's responses produced without a thread of its own while its tokens stream.

A request's path through the router is one generator (the front door's over the orchestrator's
over its decode stream's), and a thread used to drive it: after every decode step each running
request's thread woke up for one token. A StreamDriver drives the same generator, but while the
decode stream has nothing to read the generator yields WAITING and no thread waits for it: the
stream (router.request.output_mux.MuxedDecode) is parked, and the Outputs stream's reader
thread, which has the request's next tokens, resumes the generator itself and runs it up to the
next WAITING. That runs only the per-token bookkeeping, detokenization and the response's
hand-over, none of which blocks. Everything else (a finish, a pause for a live move, a failure,
a cancel, the placement and prefill before the first token) resumes it on a thread of its own,
where retries, moves and cleanup may block as before.

Whoever iterates a decode stream without a driver (the gRPC front door's handler threads) gets
the blocking stream it always had."""

from __future__ import annotations

import enum
import logging
import threading
from collections.abc import Callable, Generator
from typing import Generic, Protocol, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")


class Waiting:
    """What a driven request's generator yields while its decode stream has nothing to read."""

    def __repr__(self) -> str:
        return "WAITING"


WAITING = Waiting()


class Park(enum.Enum):
    PARKED = "parked"  # the stream resumes the driver when its next item comes
    READY = "ready"  # an item came meanwhile: go on
    ON_A_THREAD = "thread"  # an item that may block came: go on, but not on this thread


class Parkable(Protocol):
    def park(self, driver: StreamDriver) -> Park: ...


_local = threading.local()


def current_driver() -> StreamDriver | None:
    """The driver running on this thread now, if any."""
    return getattr(_local, "driver", None)


class StreamDriver(Generic[T]):
    """Runs `responses`, handing each item to `deliver`; `end` hears once how it ended (None, or
    the exception it raised)."""

    def __init__(self, responses: Generator[T | Waiting, None, None], deliver: Callable[[T], None],
                 end: Callable[[BaseException | None], None], name: str) -> None:
        self._responses = responses
        self._deliver = deliver
        self._end = end
        self._name = name
        self._lock = threading.Lock()  # one pump at a time; a resume waits for one unwinding
        self.inline = False  # pumping on a thread that must not block (the Outputs reader)
        self.waiting_on: Parkable | None = None  # set by the stream that answered WAITING

    def start(self) -> None:
        """Go on on a thread of its own."""
        threading.Thread(target=self._pump, args=(False,), name=self._name, daemon=True).start()

    def resume(self, inline: bool) -> None:
        """The parked stream has an item: go on on this thread when `inline` (a token chunk,
        handed over by the thread that must not block), else on a thread of its own. Never
        raises: the thread handing the item over serves other requests too."""
        try:
            if inline:
                self._pump(True)
            else:
                self.start()
        except Exception:  # noqa: BLE001 - e.g. no thread could start; its deadline ends it
            log.exception("resuming the responses of %s failed", self._name)

    def _pump(self, inline: bool) -> None:
        with self._lock:
            outer = current_driver()
            _local.driver, self.inline = self, inline
            try:
                self._run()
            finally:
                _local.driver = outer

    def _run(self) -> None:
        while True:
            self.waiting_on = None
            try:
                item = next(self._responses)
            except StopIteration:
                self._finish(None)
                return
            except BaseException as exc:  # noqa: BLE001 - the end hears it; this thread goes on
                self._finish(exc)
                return
            if item is not WAITING:
                try:
                    self._deliver(item)
                except Exception as exc:  # noqa: BLE001 - nobody to deliver to: stop it
                    self._stop(exc)
                    return
                continue
            if not self._park():
                return

    def _park(self) -> bool:
        """After WAITING: False when this pump is done (parked, or gone on on a thread)."""
        stream = self.waiting_on
        if stream is None:  # a bug: nothing would ever resume it
            self._stop(RuntimeError("a request's stream answered WAITING but cannot park"))
            return False
        parked = stream.park(self)
        if parked is Park.ON_A_THREAD:
            self.start()
        return parked is Park.READY

    def _stop(self, error: BaseException) -> None:
        """Close the responses (their cleanup may block: not on the thread that must not)."""
        if self.inline:
            threading.Thread(target=self._stop_on_a_thread, args=(error,), name=self._name,
                             daemon=True).start()
        else:
            self._stop_here(error)

    def _stop_on_a_thread(self, error: BaseException) -> None:
        with self._lock:  # once the inline pump that asked for it has let go
            self._stop_here(error)

    def _stop_here(self, error: BaseException) -> None:
        try:
            self._responses.close()
        except Exception:  # noqa: BLE001 - its end is what matters now
            log.exception("closing the responses of %s failed", self._name)
        self._finish(error)

    def _finish(self, error: BaseException | None) -> None:
        try:
            self._end(error)
        except Exception:  # noqa: BLE001 - the thread it runs on must go on (the reader's)
            log.exception("ending the responses of %s failed", self._name)

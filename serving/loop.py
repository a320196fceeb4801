"""The engine's step loop on its own thread.

The engine (scheduler, block manager, requests) is single-threaded by design, so gRPC handler
threads never touch it: they post commands (`call` / `post`) that run on the loop thread between
steps, and receive each request's outputs through a sink registered for its id.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Protocol, TypeVar

from engine.engine import LLMEngine, RequestOutput

log = logging.getLogger(__name__)
T = TypeVar("T")
# Loop iterations failing with no whole step between them before the worker goes down as a
# unit: a failure that repeats at every step would otherwise fail every request placed here.
MAX_FAILED_ITERATIONS = 3
PREFIX_COPY_S = 0.2  # the digest is sent with heartbeats (0.5 s): fresher copies are wasted work
Sink = Callable[[RequestOutput | BaseException], None]


@dataclass(frozen=True)
class LoadSnapshot:
    """What the worker reports to the router in each heartbeat."""

    queued_prompt_tokens: int = 0
    running_requests: int = 0
    waiting_requests: int = 0
    free_blocks: int = 0
    total_blocks: int = 0
    # Exported as metrics, not sent to the router:
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    preemptions: int = 0
    steps: int = 0
    # What the prefix cache holds (engine.block_manager.published_hashes), for cache-aware
    # placement; copied only when `prefix_version` changed, at most every PREFIX_COPY_S.
    prefix_version: int = 0
    prefix_hashes: tuple[int, ...] = ()

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hit_tokens / self.prefix_query_tokens if self.prefix_query_tokens \
            else 0.0


class OutputObserver(Protocol):
    """Sees every output delivered to a request (metrics), on the loop thread."""

    def observe_output(self, output: RequestOutput) -> None: ...

    def forget(self, request_id: str) -> None: ...


class StepPolicy(Protocol):
    """What differs between roles, around the shared schedule -> execute -> update step."""

    def before_step(self, engine: LLMEngine) -> None: ...

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None: ...


class NoPolicy:
    def before_step(self, engine: LLMEngine) -> None:
        pass

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        pass


class EngineLoop:
    def __init__(self, engine: LLMEngine, policy: StepPolicy | None = None,
                 idle_wait_s: float = 0.05, observer: OutputObserver | None = None):
        self.engine = engine
        self.policy = policy or NoPolicy()
        self.observer = observer
        self.idle_wait_s = idle_wait_s
        self.sinks: dict[str, Sink] = {}
        # Told once why the engine can never step again (a tensor-parallel rank is gone): the
        # worker then goes down as a unit, its requests failed (the router moves them).
        self.on_fatal: Callable[[str], None] | None = None
        # Run after each step's outputs went to their sinks (sinks that batch a step's outputs
        # send them then).
        self.on_step_delivered: Callable[[], None] | None = None
        self.fatal: str | None = None
        self.load = LoadSnapshot()
        self.num_steps = 0
        self._prefix_copied = 0.0
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    # ---- called from other threads -------------------------------------------------------
    def start(self) -> None:
        self._refresh_load()
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopped.set()
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
        self.engine.close()  # the tensor-parallel ranks' processes, if any

    def post(self, fn: Callable[[LLMEngine], object]) -> None:
        """Run `fn(engine)` on the loop thread before the next step (errors are logged)."""
        self._inbox.put(lambda: fn(self.engine))
        self._wakeup.set()

    def call(self, fn: Callable[[LLMEngine], T], timeout_s: float) -> T:
        """Run `fn(engine)` on the loop thread and return its result (or raise its error);
        TimeoutError when the loop does not get to it within `timeout_s`."""
        future: Future[T] = Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(self.engine))
            except BaseException as exc:  # handed to the caller
                future.set_exception(exc)

        self._inbox.put(run)
        self._wakeup.set()
        try:
            return future.result(timeout=timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        failures = 0
        try:
            self.engine.bind_thread()
            while not self._stopped.is_set():
                try:
                    if self._iterate():
                        failures = 0
                except Exception as exc:  # a role's hook or a sink: its requests fail, not it
                    log.exception("engine-loop iteration failed")
                    failures += 1
                    self._fail_all(exc)
                    if failures >= MAX_FAILED_ITERATIONS:
                        self._go_down(f"the engine loop failed {failures} times running: {exc!r}")
        except BaseException as exc:
            # The thread is ending: a worker whose loop is gone must not stay placeable, its
            # heartbeats still reporting the last load and every command timing out.
            self._go_down(f"the engine loop ended: {exc!r}")
            raise
        self._fail_all(RuntimeError("worker is shutting down"))

    def _iterate(self) -> bool:
        """One pass: commands, then a step or an idle wait. True when a step ran whole."""
        self._drain_inbox()
        self.policy.before_step(self.engine)
        stepped = self.engine.has_unfinished_requests()
        if stepped:
            stepped = self._step()
        else:
            self._wakeup.wait(self.idle_wait_s)
            self._wakeup.clear()
            self._check_broken()  # idle too: a worker that cannot step must not be placed
        self._refresh_load()
        return stepped

    def _drain_inbox(self) -> None:
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                command()
            except Exception:
                log.exception("engine-loop command failed")

    def _step(self) -> bool:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a failed forward fails its requests, not the worker
            log.exception("engine step failed")
            self._fail_all(exc)
            self._check_broken()  # ... unless it can never step again
            return False
        self.num_steps += 1
        for output in outputs:
            self.deliver(output)
        if self.on_step_delivered is not None:
            self.on_step_delivered()
        self.policy.after_step(self.engine, outputs)
        return True

    def _check_broken(self) -> None:
        broken = self.engine.broken()
        if broken is not None:
            self._go_down(broken)

    def _go_down(self, reason: str) -> None:
        """Fail every request and tell the worker to go down as a unit (once)."""
        if self.fatal is not None:
            return
        log.error("the engine cannot step again: %s", reason)
        self.fatal = reason
        try:
            self._fail_all(RuntimeError(reason))
        finally:
            if self.on_fatal is not None:
                self.on_fatal(reason)

    def deliver(self, item: RequestOutput | BaseException, request_id: str | None = None) -> None:
        """Hand an output (or an error) to the request's sink; finished requests lose theirs."""
        rid = request_id if request_id is not None else getattr(item, "request_id", None)
        sink = self.sinks.get(rid) if rid is not None else None
        if isinstance(item, BaseException) or item.finished:
            self.sinks.pop(rid, None)
        if self.observer is not None and isinstance(item, RequestOutput):
            self.observer.observe_output(item)
        if sink is not None:
            self._hand_to(sink, item, rid)
        if self.observer is not None and rid is not None and rid not in self.sinks:
            self.observer.forget(rid)  # finished, failed or handed off: no more outputs here

    def _hand_to(self, sink: Sink, item: RequestOutput | BaseException, rid: str) -> None:
        try:
            sink(item)
        except Exception:  # the reader is broken: its request stops here, its blocks freed
            log.exception("delivering an output of %s failed", rid)
            if self.sinks.pop(rid, None) is not None:
                self.engine.abort(rid)

    def hand_over(self, request_id: str, marker: object) -> None:
        """End a request's output stream here without finishing it (it leaves this worker with
        its KV): its sink gets `marker` and is dropped."""
        sink = self.sinks.pop(request_id, None)
        if self.observer is not None:
            self.observer.forget(request_id)
        if sink is not None:
            sink(marker)  # type: ignore[arg-type]  # the role's sinks know its markers

    def _fail_all(self, error: BaseException) -> None:
        for request in list(self.engine.scheduler.all_requests()):
            self.engine.abort(request.request_id)
        for rid in list(self.sinks):
            self.deliver(error, rid)

    def _refresh_load(self) -> None:
        engine = self.engine
        sched = engine.scheduler
        blocks = engine.block_manager
        queued = sum(r.num_prompt_tokens - min(r.num_computed_tokens, r.num_prompt_tokens)
                     for r in sched.all_requests())
        self.load = LoadSnapshot(
            queued_prompt_tokens=queued,
            running_requests=sched.num_running,
            waiting_requests=sched.num_waiting,
            free_blocks=blocks.num_free_blocks,
            total_blocks=blocks.num_blocks,
            prefix_query_tokens=blocks.prefix_queries,
            prefix_hit_tokens=blocks.prefix_hits,
            preemptions=sched.num_preemptions,
            steps=self.num_steps,
            **self._prefix_digest(),
        )

    def _prefix_digest(self) -> dict[str, object]:
        blocks = self.engine.block_manager
        version, now = blocks.prefix_version, time.monotonic()
        if version == self.load.prefix_version or now - self._prefix_copied < PREFIX_COPY_S:
            return {"prefix_version": self.load.prefix_version,
                    "prefix_hashes": self.load.prefix_hashes}
        self._prefix_copied = now
        return {"prefix_version": version, "prefix_hashes": tuple(blocks.published_hashes())}

    def num_in_flight(self) -> int:
        """Requests this loop still serves (queued, running or awaiting delivery); loop thread."""
        return len(set(r.request_id for r in self.engine.scheduler.all_requests())
                   | set(self.sinks))


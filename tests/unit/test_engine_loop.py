"""The engine loop's thread survives what its role's hooks and its requests' readers throw: the
requests in flight fail (their blocks freed), the worker keeps serving, and a failure that
repeats at every step, or the thread's end, takes the worker down as a unit. Model-free: a stub
engine with the loop's view of one."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from engine.engine import LLMEngine, RequestOutput
from serving.loop import MAX_FAILED_ITERATIONS, EngineLoop


class StubEngine:
    """Requests that each finish after `steps` steps, one token a step."""

    def __init__(self, steps: int = 3):
        self.steps = steps
        self.requests: dict[str, int] = {}
        self.aborted: list[str] = []
        self.scheduler = SimpleNamespace(all_requests=self._all, num_running=0, num_waiting=0,
                                         num_preemptions=0)
        self.block_manager = SimpleNamespace(num_free_blocks=8, num_blocks=8, prefix_queries=0,
                                             prefix_hits=0, prefix_version=0,
                                             published_hashes=lambda: ())

    def _all(self) -> list[SimpleNamespace]:
        return [SimpleNamespace(request_id=rid, num_prompt_tokens=1, num_computed_tokens=1)
                for rid in self.requests]

    def add(self, rid: str) -> None:
        self.requests[rid] = 0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def step(self) -> list[RequestOutput]:
        outputs = []
        for rid in list(self.requests):
            self.requests[rid] += 1
            finished = self.requests[rid] >= self.steps
            if finished:
                del self.requests[rid]
            outputs.append(SimpleNamespace(request_id=rid, finished=finished,
                                           new_token_ids=[1]))
        return outputs  # type: ignore[return-value]

    def abort(self, rid: str) -> None:
        if self.requests.pop(rid, None) is not None:
            self.aborted.append(rid)

    def broken(self) -> str | None:
        return None

    def bind_thread(self) -> None:
        pass

    def close(self) -> None:
        pass


class Policy:
    def __init__(self) -> None:
        self.fail_after_steps = 0  # the next this many after_step calls raise

    def before_step(self, engine: LLMEngine) -> None:
        pass

    def after_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        if self.fail_after_steps > 0:
            self.fail_after_steps -= 1
            raise RuntimeError("a role's hook failed")


def submit(loop: EngineLoop, rid: str) -> tuple[list[object], threading.Event]:
    """Add a request through the loop; its outputs and errors land in the list."""
    got: list[object] = []
    done = threading.Event()

    def sink(item: object) -> None:
        got.append(item)
        if isinstance(item, BaseException) or item.finished:  # type: ignore[attr-defined]
            done.set()

    def add(engine: StubEngine) -> None:
        loop.sinks[rid] = sink
        engine.add(rid)

    loop.call(add, 5)  # type: ignore[arg-type]
    return got, done


@pytest.fixture
def loop():
    engine, policy = StubEngine(), Policy()
    loop = EngineLoop(engine, policy, idle_wait_s=0.01)  # type: ignore[arg-type]
    fatal: list[str] = []
    went_down = threading.Event()
    loop.on_fatal = lambda reason: (fatal.append(reason), went_down.set())
    loop.start()
    yield SimpleNamespace(loop=loop, engine=engine, policy=policy, fatal=fatal,
                          went_down=went_down)
    loop.stop()


def test_a_hook_that_raises_fails_the_requests_in_flight_not_the_loop(loop):
    loop.policy.fail_after_steps = 1
    got, done = submit(loop.loop, "a")
    assert done.wait(5)
    assert isinstance(got[-1], RuntimeError) and "hook failed" in str(got[-1])
    assert loop.engine.aborted == ["a"] and not loop.fatal
    got, done = submit(loop.loop, "b")  # the worker still serves
    assert done.wait(5) and [o.finished for o in got] == [False, False, True]


def test_a_hook_failing_at_every_step_takes_the_worker_down(loop):
    loop.policy.fail_after_steps = 10 ** 6
    for i in range(MAX_FAILED_ITERATIONS):
        got, done = submit(loop.loop, f"r{i}")
        assert done.wait(5) and isinstance(got[-1], RuntimeError)
    assert loop.went_down.wait(5)  # told after the requests in flight were failed
    assert "failed 3 times running" in loop.fatal[0]
    assert loop.loop.fatal == loop.fatal[0]


def test_a_reader_that_raises_loses_its_request_and_its_blocks(loop):
    def broken(item: object) -> None:
        raise ConnectionError("the reader is gone")

    def add(engine: StubEngine) -> None:
        loop.loop.sinks["a"] = broken
        engine.add("a")

    loop.loop.call(add, 5)  # type: ignore[arg-type]
    got, done = submit(loop.loop, "b")
    assert done.wait(5) and [o.finished for o in got] == [False, False, True]
    assert loop.engine.aborted == ["a"] and "a" not in loop.loop.sinks and not loop.fatal


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_the_loop_thread_ending_takes_the_worker_down():
    engine = StubEngine()
    loop = EngineLoop(engine, idle_wait_s=0.01)  # type: ignore[arg-type]
    fatal: list[str] = []
    loop.on_fatal = fatal.append

    def escape(engine: StubEngine) -> None:
        raise SystemExit("a BaseException no iteration catches")

    loop._drain_inbox = lambda: escape(engine)  # type: ignore[method-assign]
    loop.start()
    loop._thread.join(5)
    assert not loop._thread.is_alive()
    assert fatal and "the engine loop ended" in fatal[0]

"""Two decode workers in one process, a running request's KV moved between them through the
connector interface (the in-process fake transport): pause at a step boundary, park, reserve on
the target, MigrateOut, admit there from the last token streamed — what the router does on a
drain or a rebalance (router.request.moving), with no process, socket or gRPC.

Output through a move equals the undisturbed engine's (greedy, and seeded sampling with
penalties); a parked request that does not move resumes where it was; every block comes back on
both sides on every path (moved, failed copy, abort while parked, lease ended)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from decode_worker.departures import Paused
from decode_worker.worker import DecodeWorker
from engine.request import SamplingParams, StructuredOutput
from kv_transfer import TransferError
from kv_transfer.fake import TRANSPORT, FakeFabric, FakeReceiveConnector, FakeSendConnector
from serving.options import WorkerOptions
from tests.engine.test_workers_over_fake_transport import engine, offline, wait_until

SECRET = "the-move's-secret"
# enough that a request is still running when its test pauses it: the tiny model steps in
# about a millisecond on one thread (64 blocks of 16 hold a 70-token prompt and these)
MAX_TOKENS = 400


class Decoders:
    """Two decode workers joined by a fake fabric, each able to send and receive."""

    def __init__(self, model_dir: str):
        self.fabric = FakeFabric()
        self.workers = [self._worker(model_dir, f"decode-{i}") for i in range(2)]
        for worker in self.workers:
            worker.loop.start()
        self.free = [self.free_blocks(w) for w in self.workers]

    def _worker(self, model_dir: str, name: str) -> DecodeWorker:
        e = engine(model_dir)
        options = WorkerOptions(role="decode", worker_id=name, router="127.0.0.1:1",
                                model=model_dir, dtype="float32")
        return DecodeWorker(
            e, options,
            lambda book, refused: [FakeReceiveConnector(self.fabric, name, e.runner.kv_buffer,
                                                        book)],
            {TRANSPORT: FakeSendConnector(self.fabric, name, e.runner.kv_buffer)})

    @staticmethod
    def free_blocks(worker: DecodeWorker) -> int:
        return worker.loop.call(lambda e: e.block_manager.num_free_blocks, 10)

    def wait_all_free(self) -> None:
        wait_until(lambda: [self.free_blocks(w) for w in self.workers] == self.free,
                   "every block back")
        assert all(len(w.departures) == 0 and len(w.table) == 0 for w in self.workers)

    def close(self) -> None:
        for worker in self.workers:
            worker.close()


@pytest.fixture()
def decoders(tiny_llama_dir) -> Iterator[Decoders]:
    pair = Decoders(str(tiny_llama_dir))
    yield pair
    pair.close()


def until_paused(worker: DecodeWorker, rid: str, outputs: Iterator, after: int) -> list[int]:
    """Read a stream, asking its worker to pause it after `after` tokens; the tokens it
    streamed before its `Paused` marker."""
    tokens: list[int] = []
    for output in outputs:
        if isinstance(output, Paused):
            return tokens
        tokens += output.new_token_ids
        if len(tokens) >= after and len(tokens) - len(output.new_token_ids) < after:
            assert worker.pause([rid], lease_s=30) == [rid]
    raise AssertionError("the stream finished without pausing")


def moved_params(params: SamplingParams, streamed: list[int]) -> SamplingParams:
    """The target's request, as router.request.events.handover builds it."""
    before = len(streamed) - 1
    return dataclasses.replace(params, max_tokens=params.max_tokens - before,
                               continued_tokens=params.continued_tokens + before)


def move(source: DecodeWorker, target: DecodeWorker, rid: str, prompt: list[int],
         params: SamplingParams, streamed: list[int]) -> list[int]:
    descriptor = target.reserve(rid, prompt + streamed[:-1], moved_params(params, streamed),
                                lease_s=60, secret=SECRET)
    stats = source.migrate_out(rid, TRANSPORT, descriptor, SECRET)
    assert stats.num_bytes > 0
    _, outputs = target.admit(rid, streamed[-1], None)
    return [t for o in outputs for t in o.new_token_ids]


PARAMS = {
    "greedy": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=MAX_TOKENS, temperature=0.8, seed=3, ignore_eos=True,
                             frequency_penalty=0.5, presence_penalty=0.2),
}


@pytest.mark.parametrize("kind", PARAMS)
def test_a_moved_request_continues_as_if_undisturbed(decoders, tiny_llama_dir,
                                                     workload_prompts, kind):
    params = PARAMS[kind]
    prompt = workload_prompts[0][:70]
    source, target = decoders.workers
    streamed = until_paused(source, "m1", source.generate("m1", prompt, params), after=5)
    assert 5 <= len(streamed) < MAX_TOKENS
    assert len(source.departures) == 1  # parked: its blocks held until the move
    rest = move(source, target, "m1", prompt, params, streamed)
    assert streamed + rest == offline(str(tiny_llama_dir), prompt, params)
    decoders.wait_all_free()


def test_a_request_moved_twice_still_matches(decoders, tiny_llama_dir, workload_prompts):
    params = PARAMS["greedy"]
    prompt = workload_prompts[1][:40]
    a, b = decoders.workers
    streamed = until_paused(a, "m2", a.generate("m2", prompt, params), after=3)
    descriptor = b.reserve("m2", prompt + streamed[:-1], moved_params(params, streamed), 60,
                           SECRET)
    a.migrate_out("m2", TRANSPORT, descriptor, SECRET)
    _, outputs = b.admit("m2", streamed[-1], None)
    more = until_paused(b, "m2", outputs, after=4)
    streamed += more
    rest = move(b, a, "m2", prompt, params, streamed)
    assert streamed + rest == offline(str(tiny_llama_dir), prompt, params)
    decoders.wait_all_free()


def test_a_parked_request_with_nowhere_to_go_resumes(decoders, tiny_llama_dir,
                                                     workload_prompts):
    params = PARAMS["greedy"]
    prompt = workload_prompts[2][:50]
    source = decoders.workers[0]
    streamed = until_paused(source, "m3", source.generate("m3", prompt, params), after=4)
    rest = [t for o in source.resume("m3") for t in o.new_token_ids]
    assert streamed + rest == offline(str(tiny_llama_dir), prompt, params)
    with pytest.raises(KeyError, match="not parked"):
        source.resume("m3")
    decoders.wait_all_free()


def test_a_failed_move_frees_both_sides(decoders, workload_prompts):
    params = PARAMS["greedy"]
    prompt = workload_prompts[3][:60]
    source, target = decoders.workers
    streamed = until_paused(source, "m4", source.generate("m4", prompt, params), after=3)
    descriptor = target.reserve("m4", prompt + streamed[:-1], moved_params(params, streamed),
                                60, SECRET)
    decoders.fabric.fail_next = True
    with pytest.raises(TransferError, match="injected"):
        source.migrate_out("m4", TRANSPORT, descriptor, SECRET)
    with pytest.raises(KeyError):  # the source let it go: the request recomputes elsewhere
        source.resume("m4")
    decoders.wait_all_free()  # the target's reservation was ended failed: nobody aborted it


def test_a_descriptor_that_does_not_fit_leaves_it_parked(decoders, workload_prompts):
    params = PARAMS["greedy"]
    prompt = workload_prompts[4][:60]
    source, target = decoders.workers
    until_paused(source, "m5", source.generate("m5", prompt, params), after=3)
    descriptor = target.reserve("m5", prompt[:10], params, 60, SECRET)  # one block, not four
    with pytest.raises(ValueError, match="computed positions"):
        source.migrate_out("m5", TRANSPORT, descriptor, SECRET)
    with pytest.raises(ValueError, match="not one this worker sends"):
        source.migrate_out("m5", "carrier-pigeon", descriptor, SECRET)
    assert len(source.departures) == 1
    assert source.abort("m5") and target.abort("m5")  # what the router does on a failed move
    decoders.wait_all_free()


def test_a_parked_request_is_freed_by_its_lease(decoders, workload_prompts):
    source = decoders.workers[0]
    outputs = source.generate("m6", workload_prompts[5][:30], PARAMS["greedy"])
    next(outputs)
    assert source.pause(["m6"], lease_s=0.2) == ["m6"]
    assert isinstance(list(outputs)[-1], Paused)
    decoders.wait_all_free()  # nobody moved or resumed it


def test_what_cannot_move_is_not_paused(decoders, workload_prompts):
    source = decoders.workers[0]
    constrained = dataclasses.replace(
        PARAMS["greedy"], structured_output=StructuredOutput("regex", "[a-z ]+"))
    outputs = source.generate("m7", workload_prompts[6][:30], constrained)
    next(outputs)
    assert source.pause(["m7", "unknown"], lease_s=30) == []
    with pytest.raises(ValueError, match="lease_s"):
        source.pause(["m7"], lease_s=0)
    assert not any(isinstance(o, Paused) for o in outputs)  # it ran to its end here
    decoders.wait_all_free()

"""A prefill worker and a decode worker in one process, their KV moved by the in-process fake
transport (kv_transfer.fake) through the connector interface: the workers' own policy —
reserve, prefill, stream, ship, admit, abort, failure — with no process, socket or gRPC.

Greedy output through them equals the offline engine's; every block comes back on both sides on
every path (finish, a failed copy, a refused secret, an abort mid-stream)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from decode_worker.worker import DecodeWorker
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.request import SamplingParams
from engine.tokenizer import Tokenizer
from kv_transfer import TransferError
from kv_transfer.fake import (
    TRANSPORT,
    FakeFabric,
    FakeReceiveConnector,
    FakeSend,
    FakeSendConnector,
)
from prefill_worker.worker import PrefillWorker
from serving.options import WorkerOptions

SECRET = "the-reservations-secret"
CHUNK = 16  # one block per prefill step: a long prompt streams over many steps


def engine(model_dir: str) -> LLMEngine:
    return LLMEngine(EngineConfig(model=model_dir, dtype="float32",
                                  cache=CacheConfig(num_blocks=64),
                                  scheduler=SchedulerConfig(max_num_batched_tokens=64,
                                                            prefill_chunk_size=CHUNK)))


class Pair:
    """One prefill and one decode worker joined by a fake fabric."""

    def __init__(self, model_dir: str, streaming: bool):
        self.fabric = FakeFabric()
        options = {"router": "127.0.0.1:1", "model": model_dir, "dtype": "float32"}
        p_engine, d_engine = engine(model_dir), engine(model_dir)
        self.prefill = PrefillWorker(
            p_engine, WorkerOptions(role="prefill", worker_id="prefill-0",
                                    kv_streaming=streaming, **options),
            {TRANSPORT: FakeSendConnector(self.fabric, "prefill-0", p_engine.runner.kv_buffer)})
        self.decode = DecodeWorker(
            d_engine, WorkerOptions(role="decode", worker_id="decode-0", **options),
            lambda book, refused: [FakeReceiveConnector(self.fabric, "decode-0",
                                                        d_engine.runner.kv_buffer, book)])
        self.prefill.loop.start()
        self.decode.loop.start()
        self.free = (self.free_blocks(self.prefill), self.free_blocks(self.decode))

    @staticmethod
    def free_blocks(worker: PrefillWorker | DecodeWorker) -> int:
        return worker.loop.call(lambda e: e.block_manager.num_free_blocks, 10)

    def generate(self, rid: str, prompt: list[int], params: SamplingParams,
                 secret: str = SECRET) -> list[int]:
        descriptor = self.decode.reserve(rid, prompt, params, lease_s=60, secret=SECRET)
        transfer = self.prefill.transfer(rid, TRANSPORT, descriptor, secret)
        first = self.prefill.prefill(prompt, params, transfer, timeout_s=60)
        _, outputs = self.decode.admit(rid, first.first_token, first.logprobs)
        return [first.first_token, *(t for o in outputs for t in o.new_token_ids)]

    def wait_all_free(self) -> None:
        wait_until(lambda: (self.free_blocks(self.prefill),
                            self.free_blocks(self.decode)) == self.free, "blocks back")
        assert len(self.decode.table) == 0 and not self.prefill.shipping

    def close(self) -> None:
        self.prefill.close()
        self.decode.close()


def wait_until(check: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture(params=["streamed", "whole"])
def pair(request, tiny_llama_dir) -> Iterator[Pair]:
    workers = Pair(str(tiny_llama_dir), streaming=request.param == "streamed")
    yield workers
    workers.close()


def offline(model_dir: str, prompt: list[int], params: SamplingParams) -> list[int]:
    reference = engine(model_dir)
    rid = reference.add_request(prompt, params)
    tokens: list[int] = []
    while reference.has_unfinished_requests():
        tokens += [t for o in reference.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


def test_greedy_through_the_connector_equals_the_offline_engine(pair, tiny_llama_dir,
                                                                workload_prompts):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    prompt = workload_prompts[0][:100]  # 7 blocks: six full ones stream before the first token
    assert pair.generate("r1", prompt, params) == offline(str(tiny_llama_dir), prompt, params)
    copies = [blocks for what, rid, blocks in pair.fabric.events if what == "copied"]
    if pair.prefill.options.kv_streaming:
        assert len(copies) > 1 and copies[0] < 7  # blocks went while later chunks computed
    else:
        assert copies == [7]  # all at once, after the first token
    assert pair.fabric.events[-1] == ("finished", "r1", 7)
    pair.wait_all_free()


def test_a_failed_copy_fails_the_prefill_and_frees_both_sides(pair, workload_prompts):
    pair.fabric.fail_next = True
    with pytest.raises(TransferError, match="injected"):
        pair.generate("r2", workload_prompts[1][:70], SamplingParams(max_tokens=4))
    pair.wait_all_free()  # the decode side's reservation was ended failed: nobody aborted it


def test_a_transfer_without_the_secret_is_refused_and_nothing_leaks(pair, workload_prompts):
    prompt = workload_prompts[2][:40]
    with pytest.raises(TransferError, match="wrong transfer secret"):
        pair.generate("r3", prompt, SamplingParams(max_tokens=4), secret="a-guess")
    assert "r3" in pair.decode.table  # refused before any write: still reserved for the real one
    assert pair.decode.abort("r3")
    pair.wait_all_free()


def test_an_abort_mid_stream_ends_the_write_and_frees_both_sides(tiny_llama_dir,
                                                                  workload_prompts):
    workers = Pair(str(tiny_llama_dir), streaming=True)
    workers.fabric.copy_delay_s = 0.1  # 25 copies: the abort lands mid-stream, even on a busy CPU
    try:
        prompt = workload_prompts[3][:400]  # 25 blocks, one per step
        params = SamplingParams(max_tokens=4)
        descriptor = workers.decode.reserve("r4", prompt, params, lease_s=60, secret=SECRET)
        transfer = workers.prefill.transfer("r4", TRANSPORT, descriptor, SECRET)
        failed: list[BaseException] = []

        def run() -> None:
            try:
                workers.prefill.prefill(prompt, params, transfer, timeout_s=60)
            except BaseException as exc:  # noqa: BLE001 - the test inspects it
                failed.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        wait_until(lambda: any(e[0] == "copied" for e in workers.fabric.events), "a first copy")
        assert workers.prefill.abort("r4")
        thread.join(30)
        assert failed and "aborted" in str(failed[0])
        assert ("aborted", "r4") in [e[:2] for e in workers.fabric.events]
        workers.wait_all_free()  # the decode worker freed the reservation at the failed end
    finally:
        workers.close()


def test_a_piece_that_cannot_be_sent_fails_its_request_not_the_worker(tiny_llama_dir,
                                                                      workload_prompts,
                                                                      monkeypatch):
    """A streamed piece whose send raises (its packed copy not allocated, say) used to end the
    prefill worker's loop thread: every later request timed out, and the decode side's blocks
    stayed held."""
    workers = Pair(str(tiny_llama_dir), streaming=True)
    try:
        def broken(self, src_block_ids):
            raise RuntimeError("out of memory packing a piece")

        with monkeypatch.context() as patch:
            patch.setattr(FakeSend, "send_ready", broken)
            with pytest.raises(TransferError, match="out of memory packing"):
                workers.generate("r9", workload_prompts[2][:100], SamplingParams(max_tokens=4))
        assert workers.prefill.loop._thread.is_alive()
        workers.decode.abort("r9")  # the router's part: nothing was written to end it
        workers.wait_all_free()
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        prompt = workload_prompts[2][:100]
        assert workers.generate("r10", prompt, params) == offline(str(tiny_llama_dir), prompt,
                                                                 params)
        workers.wait_all_free()
    finally:
        workers.close()


def test_a_second_prefill_under_a_running_or_shipping_id_is_refused(tiny_llama_dir,
                                                                    workload_prompts):
    """Refused while the first prefills and while its KV ships (detached from the engine, its
    end held): no second transfer begins, and the first ends with every block back."""
    workers = Pair(str(tiny_llama_dir), streaming=True)
    try:
        prompt = workload_prompts[4][:400]
        params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        descriptor = workers.decode.reserve("r5", prompt, params, lease_s=60, secret=SECRET)
        transfer = workers.prefill.transfer("r5", TRANSPORT, descriptor, SECRET)
        workers.fabric.finish_gate.clear()
        workers.fabric.copy_delay_s = 0.05  # 25 copies: the second call lands mid-prefill
        results: list[object] = []
        thread = threading.Thread(target=lambda: results.append(
            workers.prefill.prefill(prompt, params, transfer, timeout_s=60)))
        thread.start()
        wait_until(lambda: any(e[0] == "copied" for e in workers.fabric.events), "a first copy")
        with pytest.raises(ValueError, match="already in use"):  # still prefilling
            workers.prefill.prefill(prompt, params, transfer, timeout_s=60)
        wait_until(lambda: "r5" in workers.prefill.shipping, "the KV shipping")
        with pytest.raises(ValueError, match="already in use"):  # detached, shipping
            workers.prefill.prefill(prompt, params, transfer, timeout_s=60)
        workers.fabric.finish_gate.set()
        thread.join(30)
        first = results[0]
        _, outputs = workers.decode.admit("r5", first.first_token, first.logprobs)
        assert len([first.first_token, *(t for o in outputs for t in o.new_token_ids)]) == 3
        assert [e[0] for e in workers.fabric.events].count("finished") == 1
        workers.wait_all_free()
    finally:
        workers.fabric.finish_gate.set()
        workers.close()


def test_a_request_that_ends_at_admission_sends_only_its_end(pair, workload_prompts):
    # The prefill worker sampled the first token and the caller has it: a decode worker whose
    # request ends on that token (its own limits: here one token) sends the end, not the token.
    prompt = workload_prompts[5][:40]
    descriptor = pair.decode.reserve("e1", prompt, SamplingParams(max_tokens=1), lease_s=60,
                                     secret=SECRET)
    first = pair.prefill.prefill(prompt, SamplingParams(max_tokens=8), pair.prefill.transfer(
        "e1", TRANSPORT, descriptor, SECRET), timeout_s=60)
    _, outputs = pair.decode.admit("e1", first.first_token, first.logprobs)
    (end,) = list(outputs)
    assert end.finished and end.finish_reason == "length" and end.new_token_ids == []
    pair.wait_all_free()


def test_workers_build_text_only_to_find_stop_strings(pair, tiny_llama_dir, workload_prompts):
    prompt = workload_prompts[4][:60]
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    descriptor = pair.decode.reserve("t1", prompt, greedy, lease_s=60, secret=SECRET)
    first = pair.prefill.prefill(prompt, greedy, pair.prefill.transfer(
        "t1", TRANSPORT, descriptor, SECRET), timeout_s=60)
    _, outputs = pair.decode.admit("t1", first.first_token, first.logprobs)
    outputs = list(outputs)
    tokens = offline(str(tiny_llama_dir), prompt, greedy)
    assert [first.first_token, *(t for o in outputs for t in o.new_token_ids)] == tokens
    assert not any(o.text or o.new_text for o in outputs)  # the router detokenizes
    assert all(o.token_ids == o.new_token_ids for o in outputs)  # deltas only
    whole = Tokenizer(str(tiny_llama_dir)).decode(tokens)
    stop = whole[len(whole) // 2:len(whole) // 2 + 3]  # ends the output half-way
    stopped = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=(stop,))
    expected = offline(str(tiny_llama_dir), prompt, stopped)
    assert len(expected) < greedy.max_tokens
    assert pair.generate("t2", prompt, stopped) == expected
    pair.wait_all_free()

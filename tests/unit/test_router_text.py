"""Router-side pieces without processes: incremental detokenization, request parsing, and the
decode worker's reservation leases."""

from __future__ import annotations

import subprocess
import sys

import pytest

from decode_worker.reservations import LeaseState, ReservationTable
from engine.request import Request, SamplingParams, find_stop_string
from engine.tokenizer import Tokenizer
from router.frontdoor.detokenizer import IncrementalText


@pytest.fixture(scope="module")
def tokenizer(default_model_dir) -> Tokenizer:
    return Tokenizer(default_model_dir)


def test_router_imports_no_torch():
    code = ("import sys, router.server, launch.cluster, common.client; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_incremental_text_never_splits_a_multibyte_character(tokenizer):
    text = "naïve café — 日本語 🙂 done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stream = IncrementalText(tokenizer, [1], stop=())
    pieces = [stream.add([t]) for t in ids] + [stream.finish()]
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_a_stream_seeded_with_a_prompt_that_ends_inside_a_character(tokenizer):
    # A continued request's prompt holds the output so far, which may stop inside a character:
    # from any split, the text that follows is what the whole stream gave after it, with no
    # prompt text returned.
    prompt = tokenizer.encode("Hello there,", add_special_tokens=False)
    output = tokenizer.encode(" 日本語 😀 end", add_special_tokens=False)
    whole = tokenizer.text_stream(prompt)
    pieces = [whole.step(t) for t in output]
    assert "".join(pieces) == " 日本語 😀 end"
    for split in range(len(output)):
        stream = tokenizer.text_stream(prompt + output[:split])
        assert [stream.step(t) for t in output[split:]] == pieces[split:], split


def test_incremental_text_holds_back_and_cuts_at_a_stop_string(tokenizer):
    ids = tokenizer.encode("one two three four five", add_special_tokens=False)
    stream = IncrementalText(tokenizer, [1], stop=("three",))
    sent = "".join(stream.add([t]) for t in ids)
    assert "thr" not in sent
    assert sent + stream.finish() == "one two "
    assert stream.stopped_at == "three"


def test_incremental_text_finds_no_stop_string_before_min_tokens(tokenizer):
    # As the engine (and vLLM): the first min_tokens tokens' text is never searched, so a stop
    # string inside it does not end the text; one completed later does.
    ids = tokenizer.encode("one two one two three", add_special_tokens=False)
    early = IncrementalText(tokenizer, [1], stop=("two",))
    assert "".join(early.add([t]) for t in ids) + early.finish() == "one "
    late = IncrementalText(tokenizer, [1], stop=("two",), min_tokens=3)
    assert "".join(late.add([t]) for t in ids) + late.finish() == "one two one "
    # A stop string the min_tokens-th token completes does not count either (vLLM's rule).
    edge = IncrementalText(tokenizer, [1], stop=("two",), min_tokens=2)
    assert "".join(edge.add([t]) for t in ids) + edge.finish() == "one two one "
    never = IncrementalText(tokenizer, [1], stop=("two",), min_tokens=len(ids))
    assert "".join(never.add([t]) for t in ids) + never.finish() == "one two one two three"
    assert never.stopped_at is None


def test_stop_strings_are_found_in_the_new_text_and_what_it_completes():
    assert find_stop_string("abc\n\nThe", 3, ("\n\nThe",)) == (3, "\n\nThe")
    assert find_stop_string("abc\n\nThe end", 4, ("\n\nThe",)) is None  # an earlier token's
    assert find_stop_string("x stop y", 2, ("y", "stop")) == (7, "y")  # the stops' order
    # a continued request's text: the stop string began in the output it continues
    assert find_stop_string("The end", 7, ("\n\nThe",), context="Paris.\n\n") == (0, "\n\nThe")
    assert find_stop_string("e end", 5, ("The",), context="Th") == (0, "The")
    assert find_stop_string("ab", 2, ("xab",), context="zzx") == (0, "xab")
    assert find_stop_string("ab", 2, ("qab",), context="zzx") is None
    assert find_stop_string("ab cd", 2, ("cd",), context="zzz") == (3, "cd")
    # include_stop_str_in_output: the text ends where the stop string does
    assert find_stop_string("x stop y", 2, ("y", "stop"), include=True) == (8, "y")
    assert find_stop_string("e end", 5, ("The",), context="Th", include=True) == (1, "The")


def test_incremental_text_keeps_the_stop_string_or_special_tokens_when_asked(tokenizer):
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    kept = IncrementalText(tokenizer, [1], stop=("three",), include_stop=True)
    assert "".join(kept.add([t]) for t in ids) + kept.finish() == "one two three"
    end = tokenizer.encode("<|im_end|>", add_special_tokens=False)
    assert len(end) == 1  # one special token
    for skip, text in ((True, "one"), (False, "one<|im_end|>")):
        stream = IncrementalText(tokenizer, [1], stop=(), skip_special_tokens=skip)
        assert "".join(stream.add([t]) for t in ids[:1] + end) + stream.finish() == text


def _request(rid: str) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams())


def test_reservation_lease_expires_but_never_while_receiving():
    now = [0.0]
    released: list[str] = []
    table = ReservationTable(lambda r: released.append(r.request_id), clock=lambda: now[0])
    table.add(_request("a"), lease_s=5)
    table.add(_request("b"), lease_s=5)
    table.begin_receive("b")
    now[0] = 6
    assert table.expire() == ["a"] and released == ["a"]
    assert table.abort("b")  # deferred: the transfer still writes
    assert released == ["a"]
    assert table.end_receive("b", ok=True) is False and released == ["a", "b"]
    assert len(table) == 0


def test_reservation_ready_then_taken_or_expired():
    now = [0.0]
    released: list[str] = []
    table = ReservationTable(lambda r: released.append(r.request_id), clock=lambda: now[0])
    table.add(_request("a"), lease_s=5)
    table.begin_receive("a")
    now[0] = 100  # a long transfer: the lease restarts when it ends
    assert table.end_receive("a", ok=True)
    assert table.expire() == []
    assert table.take_ready("a").request_id == "a" and released == []
    with pytest.raises(KeyError):
        table.begin_receive("a")
    table.add(_request("c"), lease_s=5)
    table.begin_receive("c")
    assert table.end_receive("c", ok=False) is False and released == ["c"]
    assert LeaseState.READY.value == "ready"


def test_the_token_that_ends_the_request_is_left_out_of_the_text(tokenizer):
    """An EOS or a stop token id ends the text without its own, as the workers' engines and
    vLLM do, unless the stop is kept; not before min_tokens tokens."""
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    two = ids[1]
    for batch in (1, len(ids)):  # a token at a time, or all in one chunk
        text = IncrementalText(tokenizer, [1], stop=(), stop_token_ids={two})
        sent = "".join(text.add(ids[i:i + batch]) for i in range(0, len(ids), batch))
        assert sent + text.finish() == "one"
    kept = IncrementalText(tokenizer, [1], stop=(), include_stop=True, stop_token_ids={two})
    assert "".join(kept.add([t]) for t in ids) + kept.finish() == "one two"
    late = IncrementalText(tokenizer, [1], stop=(), min_tokens=3, stop_token_ids={two})
    assert "".join(late.add([t]) for t in ids) + late.finish() == "one two three four"


class Words:
    """A text stream of one word per token id."""

    def step(self, token_id: int) -> str:
        return {5: "a", 6: "x", 7: "b", 13: "\n"}[token_id]


def engine_text(tokens: list[int], **params: object) -> tuple[str, int]:
    request = Request("r", [1, 2], SamplingParams(max_tokens=8, **params), eos_token_ids=(2,))
    request.text_stream = Words()
    for token in tokens:
        if request.check_stop(request.append_token(token)):
            break
    return request.output_text, len(request.output_token_ids)


def test_the_engine_stops_as_vllm_at_min_tokens_and_at_stop_tokens():
    # "x" completed by the min_tokens-th token does not stop it; the next "x" does.
    assert engine_text([5, 6, 7, 6, 5], stop=("x",), min_tokens=2) == ("axb", 4)
    assert engine_text([5, 6, 7, 6, 5], stop=("x",), min_tokens=1) == ("a", 2)
    # A stop token id's text is left out, unless the stop is kept.
    assert engine_text([5, 13, 7], stop_token_ids=(13,)) == ("a", 2)
    assert engine_text([5, 13, 7], stop_token_ids=(13,), include_stop_str_in_output=True) == \
        ("a\n", 2)

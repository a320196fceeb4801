from __future__ import annotations

from engine.tokenizer import Tokenizer


def test_incremental_detokenization_never_splits_a_character(default_model_dir):
    tok = Tokenizer(default_model_dir)
    text = "Grüße, 日本語 and emoji 🎉🐍 — done."
    ids = tok.encode(text, add_special_tokens=False)
    stream = tok.text_stream([])
    deltas = [stream.step(i) for i in ids]
    assert "".join(deltas) == tok.decode(ids) == text
    assert all("\ufffd" not in d for d in deltas)
    assert "" in deltas  # some token ended mid-character and was held back


def test_chat_template_matches_the_prompts_of_the_shared_workload(default_model_dir):
    tok = Tokenizer(default_model_dir)
    ids = tok.encode_chat([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert tok.decode(ids, skip_special_tokens=False) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.eos_token_id == 2

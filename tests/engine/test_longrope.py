"""Phi-3's LongRoPE scaling (the 128k checkpoints): every rotary frequency divided by its own
factor — the long ones when the engine serves sequences past the pretraining length, the short
ones otherwise — and cos/sin scaled by the attention factor. A tiny random Phi-3 equals
transformers' greedy output in both regimes: sequences that stay inside the pretraining length
with the engine's max_model_len inside it too (short factors, as transformers uses for them),
and prompts past it (long factors for every position, as transformers uses once a prompt
passes it)."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.engine import LLMEngine
from engine.models.llama import rope_inv_freq
from tests.conftest import save_tiny_model
from tests.engine.hf_reference import engine_greedy, hf_greedy

ORIGINAL = 32  # the pretraining length
MAX_TOKENS = 6
# head_dim 16: 8 rotated frequencies, each with its own factor (far apart, so a wrong set shows)
SHORT = [1.0, 1.0, 1.1, 1.2, 1.5, 2.0, 2.5, 3.0]
LONG = [1.0, 2.0, 4.0, 8.0, 16.0, 24.0, 32.0, 48.0]


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, default_model_dir):
    return save_tiny_model(
        tmp_path_factory.mktemp("tiny-phi3-longrope"), "Phi3ForCausalLM", default_model_dir,
        seed=3, pad_token_id=0, max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                         "short_factor": SHORT, "long_factor": LONG})


def greedy(model_dir, prompts: list[list[int]], max_model_len: int | None) -> list[list[int]]:
    engine = LLMEngine(EngineConfig(
        model=str(model_dir), dtype="float32", max_model_len=max_model_len,
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, prefill_chunk_size=16)))
    return engine_greedy(engine, prompts, MAX_TOKENS)


def test_the_factors_follow_the_served_length_and_the_attention_factor_scales(phi3_dir):
    rope = ModelConfig.from_dir(phi3_dir).rope
    assert rope.rope_type == "longrope"
    short, short_scale = rope_inv_freq(rope, 16, ORIGINAL)
    long, long_scale = rope_inv_freq(rope, 16, 256)
    base = 1.0 / (10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(short, base / torch.tensor(SHORT))
    torch.testing.assert_close(long, base / torch.tensor(LONG))
    # Bit for bit transformers' own frequencies, on either side of the pretraining length
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = AutoConfig.from_pretrained(phi3_dir)
    for served, ours in ((ORIGINAL, short), (256, long)):
        theirs, _ = ROPE_INIT_FUNCTIONS["longrope"](config, None, served)
        assert torch.equal(ours, theirs)
    # factor = 256 / 32 = 8: sqrt(1 + ln 8 / ln 32), for both sets
    assert short_scale == long_scale == pytest.approx((1 + 3 / 5) ** 0.5)


def test_short_sequences_equal_transformers(phi3_dir, workload_prompts):
    prompts = [p[:n] for p, n in zip(workload_prompts, (5, 12, 20, 26))]
    assert greedy(phi3_dir, prompts, ORIGINAL) == hf_greedy(phi3_dir, prompts, MAX_TOKENS)


def test_prompts_past_the_pretraining_length_equal_transformers(phi3_dir, workload_prompts,
                                                                 tmp_path):
    import json
    import shutil

    prompts = [p[:n] for p, n in zip(workload_prompts, (33, 48, 90, 150))]
    got = greedy(phi3_dir, prompts, None)
    assert got == hf_greedy(phi3_dir, prompts, MAX_TOKENS)
    # The same weights with the short factors where the long ones were answer otherwise: the
    # set chosen shows in the tokens.
    short_only = shutil.copytree(phi3_dir, tmp_path / "short-only")
    config = json.loads((short_only / "config.json").read_text())
    params = config.get("rope_parameters") or config["rope_scaling"]
    params["long_factor"] = SHORT
    (short_only / "config.json").write_text(json.dumps(config))
    assert greedy(short_only, prompts, None) != got

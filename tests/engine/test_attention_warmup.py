"""The start-up warm-up runs every attention-kernel variant a server meets (under the interpreter
here: it checks the calls are well-formed; on a GPU it is what compiles them)."""

from __future__ import annotations

import torch

from engine.attention.warmup import COUNTS, warm_up_attention

# On CUDA where present (and then part of `pytest -m gpu`: tests/conftest.py).
RUNS_ON_CUDA = True


def test_warm_up_covers_every_split_count_and_integer_specialisation():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ran = warm_up_attention(n_heads=4, n_kv=2, head_dim=16, block_size=16,
                            dtype=torch.float32, device=device, max_splits=4)
    assert {(k, s) for k, s, _ in ran} == {("write", 1), ("decode", 1), ("decode", 2),
                                           ("decode", 4), ("prefill", 1)}
    for kind in ("write", "decode", "prefill"):
        assert {c for k, _, c in ran if k == kind} == set(COUNTS)


def test_warm_up_runs_the_models_windowed_and_soft_capped_layers_too():
    """Gemma-style layers (a sliding window, a soft cap) are kernel variants of their own:
    warmed up with the model's own values, not met first inside a request."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kinds = [(None, 50.0), (4096, 50.0)]
    ran = warm_up_attention(n_heads=4, n_kv=2, head_dim=16, block_size=16,
                            dtype=torch.float32, device=device, max_splits=2,
                            layer_kinds=kinds)
    decodes = [r for r in ran if r[0] == "decode"]
    assert len(decodes) == len(COUNTS) * 2 * len(kinds)


def test_the_layer_kinds_are_the_models_own(tmp_path, default_model_dir):
    from engine.attention.warmup import layer_kinds
    from engine.config import ModelConfig
    from tests.conftest import save_tiny_model
    from tests.model_families import FAMILIES

    arch, overrides = FAMILIES["gemma2"]
    gemma2 = ModelConfig.from_dir(save_tiny_model(tmp_path, arch, default_model_dir, seed=5,
                                                  **overrides))
    assert layer_kinds(gemma2) == [(24, 5.0), (None, 5.0)]
    assert layer_kinds(ModelConfig.from_dir(default_model_dir)) == [(None, None)]

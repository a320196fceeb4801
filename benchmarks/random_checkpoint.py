"""Random-weight Llama checkpoints of the GPU benchmark's model shapes, in HF layout, so a GPU
machine with no model hub can measure the 135M, 1B and 8B shapes (`benchmarks.gpu_engine`)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    "smol135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True),
    "llama1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True),
    "llama8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
}
VOCAB = 49152  # the default tokenizer's
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def write_checkpoint(shape: str, path: Path, tokenizer_dir: Path, device: str) -> Path:
    """Random bf16 weights (std 0.02, norms 1) in HF Llama layout, written layer by layer (one
    safetensors shard each, so an 8B shape never sits in host memory whole). Kept if present."""
    from safetensors.torch import save_file

    if not (tokenizer_dir / "tokenizer.json").is_file():  # else every engine fails much later
        raise FileNotFoundError(f"no tokenizer.json in {str(tokenizer_dir)!r} (the tokenizer "
                                "directory: on a GPU machine, .gpu/tokenizer, carried)")
    if (path / "config.json").is_file():
        _copy_tokenizer(tokenizer_dir, path)  # a checkpoint written without one gets it now
        return path
    path.mkdir(parents=True, exist_ok=True)
    s = SHAPES[shape]
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*dims: int) -> torch.Tensor:
        return (torch.randn(*dims, generator=gen, device=device) * 0.02).bfloat16().cpu()

    index: dict[str, str] = {}
    for i, shard in enumerate(_shards(s, rand)):
        name = f"model-{i:05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": index}))
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=VOCAB,
                  max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=500000.0,
                  bos_token_id=1, eos_token_id=2, hidden_act="silu", torch_dtype="bfloat16", **s)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    _copy_tokenizer(tokenizer_dir, path)
    return path


def _copy_tokenizer(tokenizer_dir: Path, path: Path) -> None:
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, path / name)


def _shards(s: dict[str, Any], rand: Callable[..., torch.Tensor]
            ) -> Iterator[dict[str, torch.Tensor]]:
    """The embedding (and untied head) first, then one shard per decoder layer, made lazily."""
    h, inter = s["hidden_size"], s["intermediate_size"]
    kv = s["num_key_value_heads"] * h // s["num_attention_heads"]
    ones = torch.ones(h, dtype=torch.bfloat16)
    first = {"model.embed_tokens.weight": rand(VOCAB, h), "model.norm.weight": ones}
    if not s["tie_word_embeddings"]:
        first["lm_head.weight"] = rand(VOCAB, h)
    yield first
    for layer in range(s["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        yield {p + "self_attn.q_proj.weight": rand(h, h),
               p + "self_attn.k_proj.weight": rand(kv, h),
               p + "self_attn.v_proj.weight": rand(kv, h),
               p + "self_attn.o_proj.weight": rand(h, h),
               p + "mlp.gate_proj.weight": rand(inter, h),
               p + "mlp.up_proj.weight": rand(inter, h),
               p + "mlp.down_proj.weight": rand(h, inter),
               p + "input_layernorm.weight": ones.clone(),
               p + "post_attention_layernorm.weight": ones.clone()}


def main(argv: list[str] | None = None) -> None:
    """`python -m benchmarks.random_checkpoint SHAPE --tokenizer DIR (--out DIR | --as-default)`:
    a machine without the default model's package (a GPU machine) gets a random checkpoint of
    its shape in its place, so every `default` in the tests and benchmarks loads."""
    import argparse

    from engine.prepare import _COMPLETE_MARKER, default_model_dir

    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_checkpoint")
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--tokenizer", type=Path, required=True,
                        help="a folder with the default model's tokenizer files")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--as-default", action="store_true",
                        help="write it where the default model is looked for")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args(argv)
    if (args.out is None) == (not args.as_default):
        parser.error("give exactly one of --out DIR and --as-default")
    path = default_model_dir() if args.as_default else args.out
    write_checkpoint(args.shape, path, args.tokenizer, args.device)
    if args.as_default:
        (path / _COMPLETE_MARKER).touch()
    print(path)


if __name__ == "__main__":
    main()

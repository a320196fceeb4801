"""Load a local Hugging Face Llama / Mistral / Qwen2 safetensors checkpoint (sharded or not, tied or
untied embeddings, attention bias) into the fused layout the model runs. Never downloads."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from engine.config import ModelConfig, ModelPathError
from engine.prepare import default_model_dir, is_prepared, prepare_default_model

DEFAULT_MODEL = "default"


def resolve_model_path(model: str) -> Path:
    """`default` is the prepared SmolLM2 checkpoint (prepared on first use); anything else must be
    a local directory."""
    if model == DEFAULT_MODEL:
        path = default_model_dir()
        return path if is_prepared(path) else prepare_default_model(path)
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelPathError(f"model path {model!r} does not exist (hub downloads are disabled)")
    if not path.is_dir():
        raise ModelPathError(f"model path {model!r} is not a directory")
    return path


def safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [path / s for s in shards]
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ModelPathError(f"checkpoint {str(path)!r} is missing shards: {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        found = sorted(p.name for p in path.iterdir())[:10]
        raise ModelPathError(f"no *.safetensors files in {str(path)!r} (found: {found})")
    return files


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
                 ) -> dict[str, torch.Tensor]:
    """Read the checkpoint and return fused weights keyed as engine.models.llama expects."""
    raw: dict[str, torch.Tensor] = {}
    for file in safetensors_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if "rotary_emb" in name:
                    continue
                raw[name.removeprefix("model.")] = f.get_tensor(name)
    return _fuse(raw, config, dtype, device)


def _take(raw: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return raw.pop(name)
    except KeyError:
        raise ModelPathError(f"checkpoint is missing weight {name!r}") from None


def _fuse(raw: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype,
          device: torch.device) -> dict[str, torch.Tensor]:
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    out = {"embed": put(_take(raw, "embed_tokens.weight")), "norm": put(_take(raw, "norm.weight"))}
    if "lm_head.weight" in raw and not config.tie_word_embeddings:
        out["lm_head"] = put(raw.pop("lm_head.weight"))
    elif not config.tie_word_embeddings:
        raise ModelPathError("checkpoint has untied embeddings but no 'lm_head.weight'")
    raw.pop("lm_head.weight", None)
    for i in range(config.num_layers):
        p = f"layers.{i}."
        q, k, v = (_take(raw, f"{p}self_attn.{n}_proj.weight") for n in "qkv")
        out[p + "qkv_weight"] = put(torch.cat([q, k, v]))
        if config.attention_bias:
            biases = [_take(raw, f"{p}self_attn.{n}_proj.bias") for n in "qkv"]
            out[p + "qkv_bias"] = put(torch.cat(biases))
        out[p + "o_weight"] = put(_take(raw, f"{p}self_attn.o_proj.weight"))
        if f"{p}self_attn.o_proj.bias" in raw:  # Llama with attention_bias; Qwen2 has none
            out[p + "o_bias"] = put(raw.pop(f"{p}self_attn.o_proj.bias"))
        gate, up = _take(raw, f"{p}mlp.gate_proj.weight"), _take(raw, f"{p}mlp.up_proj.weight")
        out[p + "gate_up_weight"] = put(torch.cat([gate, up]))
        out[p + "down_weight"] = put(_take(raw, f"{p}mlp.down_proj.weight"))
        out[p + "input_norm"] = put(_take(raw, f"{p}input_layernorm.weight"))
        out[p + "post_attention_norm"] = put(_take(raw, f"{p}post_attention_layernorm.weight"))
    leftover = list(raw)
    if leftover:
        raise ModelPathError(f"checkpoint has weights this model does not use: {leftover[:5]}")
    return out

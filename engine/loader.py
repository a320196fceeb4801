"""Load a local Hugging Face Llama / Mistral / Qwen2 safetensors checkpoint (sharded or not, tied or
untied embeddings, attention bias) into the fused layout the model runs — whole, or the slices one
tensor-parallel rank holds (engine.tensor_parallel), read as slices from the files. Never
downloads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from engine.config import ModelConfig, ModelPathError
from engine.prepare import default_model_dir, is_prepared, prepare_default_model
from engine.tensor_parallel import ShardPlan, split

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


def load_weights(path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: ShardPlan | None = None) -> dict[str, torch.Tensor]:
    """Read the checkpoint and return fused weights keyed as engine.models.llama expects; with
    `shard`, only the slices that tensor-parallel rank holds are read from the files."""
    with CheckpointReader(path) as reader:
        out = _fuse(reader, config, dtype, device, shard)
        leftover = reader.unread()
    if leftover:
        raise ModelPathError(f"checkpoint has weights this model does not use: {leftover[:5]}")
    return out


class CheckpointReader:
    """Tensors of a safetensors checkpoint by name, read when asked for (whole or a slice)."""

    def __init__(self, path: Path):
        self._files = [safe_open(str(f), framework="pt") for f in safetensors_files(path)]
        self._where: dict[str, tuple[Any, str]] = {}
        for handle in self._files:
            for name in handle.keys():
                if "rotary_emb" not in name:
                    self._where[name.removeprefix("model.")] = (handle, name)
        self._read: set[str] = set()

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._files.clear()

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str, rows: range | None = None, cols: range | None = None
            ) -> torch.Tensor:
        """The tensor `name` (ModelPathError if missing), or its `rows` / `cols` slice."""
        found = self._where.get(name)
        if found is None:
            raise ModelPathError(f"checkpoint is missing weight {name!r}")
        handle, key = found
        self._read.add(name)
        if rows is None and cols is None:
            return handle.get_tensor(key)
        part = handle.get_slice(key)
        r = slice(rows.start, rows.stop) if rows is not None else slice(None)
        if cols is None:
            return part[r]
        return part[r, cols.start:cols.stop]

    def skip(self, name: str) -> None:
        """Mark a weight as deliberately not used."""
        if name in self._where:
            self._read.add(name)

    def unread(self) -> list[str]:
        return [n for n in self._where if n not in self._read]


def _fuse(reader: CheckpointReader, config: ModelConfig, dtype: torch.dtype,
          device: torch.device, shard: ShardPlan | None) -> dict[str, torch.Tensor]:
    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    vocab = None if shard is None else shard.vocab
    out = {"embed": put(_vocab_rows(reader.get("embed_tokens.weight", vocab), shard)),
           "norm": put(_norm(reader.get("norm.weight"), config))}
    if "lm_head.weight" in reader and not config.tie_word_embeddings:
        out["lm_head"] = put(_vocab_rows(reader.get("lm_head.weight", vocab), shard))
    elif not config.tie_word_embeddings:
        raise ModelPathError("checkpoint has untied embeddings but no 'lm_head.weight'")
    reader.skip("lm_head.weight")
    for i in range(config.num_layers):
        p = f"layers.{i}."
        out.update(_layer(reader, p, config, shard, put))
        if config.moe_layers and config.moe_layers[i]:
            out.update(_experts(reader, p, config, shard, put))
        else:
            out.update(_dense_mlp(reader, p, config, shard, put))
    return out


def _layer(reader: CheckpointReader, p: str, config: ModelConfig, shard: ShardPlan | None,
           put: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    d = config.head_dim
    q_rows = None if shard is None else range(shard.q_heads.start * d, shard.q_heads.stop * d)
    kv_rows = None if shard is None else range(shard.kv_heads.start * d,
                                               shard.kv_heads.stop * d)
    rows = {"q": q_rows, "k": kv_rows, "v": kv_rows}
    if config.fused_checkpoint:
        out = {p + "qkv_weight": put(_fused_qkv(reader, f"{p}self_attn.qkv_proj.weight", config,
                                                q_rows, kv_rows))}
    else:
        out = {p + "qkv_weight": put(torch.cat([
            reader.get(f"{p}self_attn.{n}_proj.weight", rows[n]) for n in "qkv"]))}
    if config.attention_bias:
        out[p + "qkv_bias"] = put(torch.cat([reader.get(f"{p}self_attn.{n}_proj.bias", rows[n])
                                             for n in "qkv"]))
    if config.qk_norm:  # over head_dim: the same on every rank
        for n in ("q", "k"):
            out[f"{p}{n}_norm"] = put(_norm(reader.get(f"{p}self_attn.{n}_norm.weight"), config))
    out[p + "o_weight"] = put(reader.get(f"{p}self_attn.o_proj.weight", None, q_rows))
    bias = f"{p}self_attn.o_proj.bias"  # Llama with attention_bias; Qwen2 has none
    if bias in reader:
        if shard is None or shard.rank == 0:  # row-parallel: added once, before the all-reduce
            out[p + "o_bias"] = put(reader.get(bias))
        reader.skip(bias)
    norms = {"input_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm"}
    if config.gemma is not None:  # a norm before and after the MLP too
        norms.update(pre_mlp_norm="pre_feedforward_layernorm",
                     post_mlp_norm="post_feedforward_layernorm")
    for key, name in norms.items():
        out[p + key] = put(_norm(reader.get(f"{p}{name}.weight"), config))
    return out


def _norm(weight: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """An RMSNorm weight as the model multiplies by it: Gemma stores w for a scale of 1 + w
    (added in float32, as transformers computes it)."""
    return weight.float() + 1.0 if config.gemma is not None else weight


def _dense_mlp(reader: CheckpointReader, p: str, config: ModelConfig, shard: ShardPlan | None,
               put: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    mlp = None if shard is None else shard.intermediate
    if config.fused_checkpoint:  # gate rows, then up rows
        name, size = f"{p}mlp.gate_up_proj.weight", config.intermediate_size
        share = mlp or range(size)
        gate_up = [reader.get(name, range(share.start + o, share.stop + o)) for o in (0, size)]
    else:
        gate_up = [reader.get(f"{p}mlp.{n}_proj.weight", mlp) for n in ("gate", "up")]
    return {p + "gate_up_weight": put(torch.cat(gate_up)),
            p + "down_weight": put(reader.get(f"{p}mlp.down_proj.weight", None, mlp))}


# Per-expert weight names (gate, up, down) by where the block lives: Mixtral's checkpoints, and
# Qwen3-MoE's.
EXPERT_NAMES = {"block_sparse_moe": ("w1", "w3", "w2"),
                "mlp": ("gate_proj", "up_proj", "down_proj")}


def _experts(reader: CheckpointReader, p: str, config: ModelConfig, shard: ShardPlan | None,
             put: Callable[[torch.Tensor], torch.Tensor]) -> dict[str, torch.Tensor]:
    """A mixture's router and its experts stacked: gate/up [E, 2 I, H], down [E, H, I] (I: this
    rank's share of each expert), from the per-expert tensors checkpoints hold (transformers
    too writes them so)."""
    moe = config.moe
    assert moe is not None
    size = moe.intermediate_size
    share = range(size) if shard is None else split(size, shard.rank, shard.size)
    if not share:
        raise ValueError(f"tensor_parallel_size {shard.size} is more than the experts' width "
                         f"{size}: a rank would hold nothing of them")
    block = "block_sparse_moe" if f"{p}block_sparse_moe.gate.weight" in reader else "mlp"
    router = reader.get(f"{p}{block}.gate.weight")
    gate_n, up_n, down_n = EXPERT_NAMES[block]
    e = f"{p}{block}.experts."
    gate_up = torch.stack([torch.cat([reader.get(f"{e}{i}.{gate_n}.weight", share),
                                      reader.get(f"{e}{i}.{up_n}.weight", share)])
                           for i in range(moe.num_experts)])
    down = torch.stack([reader.get(f"{e}{i}.{down_n}.weight", None, share)
                        for i in range(moe.num_experts)])
    out = {p + "router": put(router), p + "experts_gate_up": put(gate_up),
           p + "experts_down": put(down)}
    if moe.shared_intermediate_size:
        out.update(_shared_expert(reader, f"{p}{block}.", moe.shared_intermediate_size, shard,
                                  put, p))
    return out


def _shared_expert(reader: CheckpointReader, block: str, size: int, shard: ShardPlan | None,
                   put: Callable[[torch.Tensor], torch.Tensor], p: str) -> dict[str, torch.Tensor]:
    """Qwen2-MoE's shared expert (split like a dense MLP under tensor parallelism) and its
    gate (one row, whole on every rank: sigmoid(gate . x) scales each rank's share alike)."""
    share = range(size) if shard is None else split(size, shard.rank, shard.size)
    if not share:
        raise ValueError(f"tensor_parallel_size {shard.size} is more than the shared expert's "
                         f"width {size}: a rank would hold nothing of it")
    e = f"{block}shared_expert."
    gate_up = torch.cat([reader.get(f"{e}gate_proj.weight", share),
                         reader.get(f"{e}up_proj.weight", share)])
    return {p + "shared_gate_up": put(gate_up),
            p + "shared_down": put(reader.get(f"{e}down_proj.weight", None, share)),
            p + "shared_gate": put(reader.get(f"{block}shared_expert_gate.weight"))}


def _fused_qkv(reader: CheckpointReader, name: str, config: ModelConfig,
               q_rows: range | None, kv_rows: range | None) -> torch.Tensor:
    """A fused qkv_proj (q rows, then k's, then v's): whole, or a rank's rows of each part."""
    if q_rows is None or kv_rows is None:
        return reader.get(name)
    k_at = config.num_heads * config.head_dim
    v_at = k_at + config.num_kv_heads * config.head_dim
    return torch.cat([reader.get(name, q_rows),
                      reader.get(name, range(kv_rows.start + k_at, kv_rows.stop + k_at)),
                      reader.get(name, range(kv_rows.start + v_at, kv_rows.stop + v_at))])


def _vocab_rows(rows: torch.Tensor, shard: ShardPlan | None) -> torch.Tensor:
    """A rank's vocabulary rows, padded with zeros to the shard size every rank shares."""
    if shard is None or rows.shape[0] == shard.vocab_shard:
        return rows
    pad = rows.new_zeros(shard.vocab_shard - rows.shape[0], rows.shape[1])
    return torch.cat([rows, pad])

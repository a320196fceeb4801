"""Llama-family decoder (Llama, Mistral, Qwen2/3, Phi-3, Mixtral, Qwen3-MoE, Gemma 3) over a
flattened ragged batch, no padding.

Weights are fused at load time (q/k/v into one matrix, gate/up into one) so each layer runs four
matmuls. Numerics follow transformers' implementation (fp32 RMSNorm statistics, fp32 RoPE tables)
so float32 greedy output is token-identical to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata
from engine.config import ModelConfig, RopeConfig
from engine.models.elementwise import TorchElementwise, rms_norm
from engine.models.linear import Linear
from engine.models.moe import MoEMLP
from engine.tensor_parallel import ShardPlan, TPGroup


def rope_inv_freq(rope: RopeConfig, head_dim: int, max_positions: int
                  ) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and the attention scaling factor for the checkpoint's rope type
    (`max_positions`: the engine's longest sequence, which picks longrope's factors)."""
    if float(rope.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError(f"partial_rotary_factor {rope.get('partial_rotary_factor')} is not "
                         "supported: RoPE rotates whole heads here")
    powers = rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    inv_freq = 1.0 / powers
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / float(rope.get("factor")), 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    if rope.rope_type == "longrope":
        return _longrope_inv_freq(powers, rope, max_positions)
    raise ValueError(
        f"unsupported rope_type {rope.rope_type!r}; supported: default, linear, llama3, longrope"
    )


def _longrope_inv_freq(powers: torch.Tensor, rope: RopeConfig, max_positions: int
                       ) -> tuple[torch.Tensor, float]:
    """Phi-3's LongRoPE (`powers`: theta^(2i/d)): every frequency divided by its own factor —
    the long ones where the engine serves sequences past the pretraining length, else the short
    ones — and cos/sin scaled by the attention factor. One set for every position, fixed at
    start (as vLLM does): KV computed under one set stays valid as a sequence grows, where
    transformers switches sets in mid-sequence once it passes the pretraining length."""
    original = int(rope.get("original_max_position_embeddings"))
    factors = rope.get("long_factor" if max_positions > original else "short_factor")
    if factors is None or len(factors) != powers.numel():
        raise ValueError(f"longrope needs short_factor and long_factor of {powers.numel()} "
                         f"values each (one per rotated frequency)")
    factor = rope.get("factor")
    if factor is None:
        factor = float(rope.get("max_position_embeddings", original)) / original
    attention = rope.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    # 1 / (factor * theta^(2i/d)), in transformers' order: bit for bit its frequencies (the
    # same quotient taken as (1 / theta^(2i/d)) / factor rounds differently in a third of them)
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * powers), float(attention)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    factor = float(rope.get("factor"))
    low, high = float(rope.get("low_freq_factor")), float(rope.get("high_freq_factor"))
    old_len = float(rope.get("original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """cos/sin tables for every position up to max_positions, looked up per token."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int, dtype: torch.dtype,
                 device: torch.device):
        inv_freq, scaling = rope_inv_freq(rope, head_dim, max_positions)
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (emb.sin() * scaling).to(dtype=dtype, device=device)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape [T, 1, D]; looked up once per step and shared by every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


class DecoderLayer:
    def __init__(self, weights: dict[str, torch.Tensor], config: ModelConfig, tp: TPGroup,
                 shard: ShardPlan | None, window: int | None = None):
        self.qkv_proj = Linear(weights["qkv_weight"], weights.get("qkv_bias"))
        self.o_proj = Linear(weights["o_weight"], weights.get("o_bias"))
        self._build_mlp(weights, config)
        self.input_norm = weights["input_norm"]
        # Gemma: a norm before and after the MLP, and after attention, each before its residual
        self.sandwich = (weights["pre_mlp_norm"], weights["post_mlp_norm"]) \
            if "pre_mlp_norm" in weights else None
        # Qwen3: per-head RMSNorm of q and k before RoPE
        self.qk_norms = (weights["q_norm"], weights["k_norm"]) if "q_norm" in weights else None
        self.post_attention_norm = weights["post_attention_norm"]
        self.eps = config.rms_norm_eps
        self.window = window  # sliding-window attention: the last `window` keys only
        self.tp = tp  # o_proj and down_proj hold input columns: their outputs are summed
        self.n_heads, self.n_kv = config.num_heads, config.num_kv_heads
        if shard is not None:  # this rank's heads
            self.n_heads, self.n_kv = len(shard.q_heads), len(shard.kv_heads)
        self.head_dim = config.head_dim
        self.q_size = self.n_heads * self.head_dim
        self.kv_size = self.n_kv * self.head_dim
        gemma = config.gemma
        self.scale = gemma.attention_scale if gemma else self.head_dim ** -0.5
        self.softcap = gemma.attention_softcap if gemma else None  # Gemma 2
        self.local_rope = gemma is not None and window is not None  # Gemma's sliding layers

    def _build_mlp(self, weights: dict[str, torch.Tensor], config: ModelConfig) -> None:
        self.moe = None  # a mixture of experts instead of the dense MLP (Mixtral, Qwen3-MoE)
        self.gelu = config.gemma is not None  # GELU-tanh (Gemma), else SiLU
        if "router" in weights:
            shared = (weights["shared_gate_up"], weights["shared_down"], weights["shared_gate"]) \
                if "shared_gate" in weights else None
            self.moe = MoEMLP(config.moe, weights["router"], weights["experts_gate_up"],
                              weights["experts_down"], shared=shared)
        else:
            self.gate_up_proj = Linear(weights["gate_up_weight"])
            self.down_proj = Linear(weights["down_weight"])

    def forward(self, h: torch.Tensor, pending: torch.Tensor | None,
                rope: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                md: AttentionMetadata, attention: AttentionBackend, ops: TorchElementwise
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(residual stream, the MLP output still to be added to it, or None). Where `ops`
        defers the residual add, the next layer's input norm adds `pending` in its own pass:
        the same sum, one tensor op fewer a layer."""
        h, x = ops.add_rms_norm(h, pending, self.input_norm, self.eps)
        if self.qk_norms is None:
            q, k, v = ops.rope_qkv(self.qkv_proj(x), rope, self.n_heads, self.n_kv,
                                   self.head_dim)
        else:
            q, k, v = ops.norm_rope_qkv(self.qkv_proj(x), rope, self.n_heads, self.n_kv,
                                        self.head_dim, self.qk_norms, self.eps)
        attn = self.tp.all_reduce(self.o_proj(self._attend(q, k, v, kv_cache, md, attention)))
        if self.sandwich is not None:
            return self._sandwiched(h, attn, ops), None
        h, x = ops.add_rms_norm(h, attn, self.post_attention_norm, self.eps)
        mlp = self.tp.all_reduce(self._mlp(x, ops))
        return (h, mlp) if ops.defers_residual else (h + mlp, None)

    def _sandwiched(self, h: torch.Tensor, attn: torch.Tensor, ops: TorchElementwise
                    ) -> torch.Tensor:
        """Gemma's rest of the layer: attention and MLP outputs normed before their residual."""
        pre, post = self.sandwich
        h = h + rms_norm(attn, self.post_attention_norm, self.eps)
        mlp = self.tp.all_reduce(self._mlp(rms_norm(h, pre, self.eps), ops))
        return h + rms_norm(mlp, post, self.eps)

    def _mlp(self, x: torch.Tensor, ops: TorchElementwise) -> torch.Tensor:
        if self.moe is not None:
            return self.moe(x)
        if self.gelu:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(F.gelu(gate, approximate="tanh") * up)
        return self.down_proj(ops.silu_mul(self.gate_up_proj(x)))

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata, attention: AttentionBackend) -> torch.Tensor:
        """Store this step's K/V in the layer's cache, attend; [T, q_size]."""
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        attention.write_kv(k, v, k_cache, v_cache, md.slot_mapping)
        attn = attention(q, k_cache, v_cache, md.block_table, md.seq_lens, md.query_start_loc,
                         scale=self.scale, max_query_len=md.max_query_len,
                         max_seq_len=md.max_seq_len, new_kv=(k, v),
                         num_kv_splits=md.num_kv_splits, window=self.window,
                         softcap=self.softcap)
        return attn.reshape(q.shape[0], self.q_size)


class LlamaModel:
    """The whole decoder; `forward` returns the logits of the rows in `logits_indices`."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], max_positions: int,
                 elementwise: TorchElementwise | None = None, tp: TPGroup | None = None,
                 shard: ShardPlan | None = None):
        """`tp` and `shard`: this rank's group and share (engine.tensor_parallel); the weights
        are that share's (engine.loader)."""
        self.config = config
        self.tp = tp or TPGroup(0, 1)
        self.shard = shard
        # The element-wise chains: the torch form, or fused kernels (engine.models.elementwise).
        self.elementwise = elementwise or TorchElementwise()
        self.embed = weights["embed"]
        self.lm_head = Linear(weights.get("lm_head", self.embed))
        self.norm = weights["norm"]
        windows = config.layer_windows or (None,) * config.num_layers
        self.layers = [DecoderLayer(weights_i, config, self.tp, shard, window)
                       for weights_i, window in zip(_split_layers(weights), windows)]
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions,
                                      self.embed.dtype, self.embed.device)
        # Gemma: its sliding layers rotate with their own base
        self.rotary_local = None if config.gemma is None else RotaryEmbedding(
            config.gemma.rope_local, config.head_dim, max_positions, self.embed.dtype,
            self.embed.device)

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], md: AttentionMetadata, attention: AttentionBackend,
                logits_indices: torch.Tensor, float_logits: bool = True) -> torch.Tensor:
        """The logits of the rows in `logits_indices`: float32, or with `float_logits` False
        in the model's dtype (the CPU runner's sampler widens them only where it must)."""
        h = self._embed(input_ids)
        ropes = {False: self.rotary.lookup(positions)}
        if self.rotary_local is not None:
            ropes[True] = self.rotary_local.lookup(positions)
        pending = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, pending = layer.forward(h, pending, ropes[layer.local_rope], kv_cache, md,
                                       attention, self.elementwise)
        h = h[logits_indices] if pending is None else h[logits_indices] + pending[logits_indices]
        h = rms_norm(h, self.norm, self.config.rms_norm_eps)
        logits = self.lm_head(h)
        if self.shard is not None:  # each rank scored its vocabulary rows
            logits = self.tp.gather_columns(logits, self.config.vocab_size)
        gemma = self.config.gemma
        if gemma is not None and gemma.final_logit_softcap:
            cap = gemma.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float() if float_logits else logits

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self._lookup(input_ids)
        if self.config.gemma is not None:  # scaled by sqrt(hidden), in the weights' dtype
            h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        return h

    def _lookup(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.shard is None:
            return F.embedding(input_ids, self.embed)
        # Vocabulary-parallel: each rank looks up the ids in its rows, zeros elsewhere; summed.
        local = input_ids - self.shard.vocab.start
        mine = (local >= 0) & (local < len(self.shard.vocab))
        h = F.embedding(local.clamp(0, self.embed.shape[0] - 1), self.embed)
        return self.tp.all_reduce(h * mine.unsqueeze(-1).to(h.dtype))


def _split_layers(weights: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    layers: dict[int, dict[str, torch.Tensor]] = {}
    for name, tensor in weights.items():
        if name.startswith("layers."):
            _, index, key = name.split(".", 2)
            layers.setdefault(int(index), {})[key] = tensor
    return [layers[i] for i in sorted(layers)]

"""The architectures the engine runs, in one registry: what each config.json `architectures` name
means for the one decoder (engine.models.llama) and its loader. Plain Python, no torch.

Anything else — another architecture, a rope type, a layer type, a feature the decoder lacks — is
refused when the config is read, naming it and what is supported."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from engine.config import GemmaTraits, ModelPathError, MoEConfig, RopeConfig

Raw = dict[str, Any]


@dataclass(frozen=True)
class Family:
    qk_norm: bool = False  # RMSNorm over each head of q and k, before RoPE
    fused_checkpoint: bool = False  # q/k/v stored as one qkv_proj, gate/up as one gate_up_proj
    attention_bias: bool = False  # q/k/v biases when config.json does not say
    window_needs_flag: bool = False  # its sliding_window applies only with use_sliding_window
    window_from_max_layers: bool = False  # the layers from max_window_layers on slide (Qwen2)
    extra: Callable[[Raw, int], dict[str, Any]] | None = None  # MoE or Gemma fields


def find(raw: Raw, source: str) -> tuple[str, Family]:
    """The config's architecture and its family (ModelPathError when it is not supported)."""
    arch = (raw.get("architectures") or [raw.get("model_type", "<none>")])[0]
    family = ARCHITECTURES.get(arch)
    if family is None:
        raise ModelPathError(f"unsupported architecture {arch!r} in {source}; supported: "
                             f"{', '.join(ARCHITECTURES)}")
    return arch, family


def family_fields(raw: Raw, family: Family, layers: int, source: str) -> dict[str, Any]:
    """The ModelConfig fields the family decides."""
    window = raw.get("sliding_window")
    if family.window_needs_flag and not raw.get("use_sliding_window", False):
        window = None
    window = int(window) if window else None
    fields = {"rope": rope_from_hf(raw), "qk_norm": family.qk_norm,
              "fused_checkpoint": family.fused_checkpoint,
              "attention_bias": bool(raw.get("attention_bias",
                                             raw.get("qkv_bias", family.attention_bias))),
              "sliding_window": window,
              "layer_windows": _layer_windows(raw, family, window, layers, source)}
    if family.extra is not None:
        fields.update(family.extra(raw, layers))
    return fields


def _layer_windows(raw: Raw, family: Family, window: int | None, layers: int, source: str
                   ) -> tuple[int | None, ...]:
    """Each layer's sliding window: from `layer_types` where the config lists them (transformers
    5), else from Qwen2's `max_window_layers` (the layers from that index on slide), else the one
    window on every layer (Mistral)."""
    if window is None:
        return ()
    types = raw.get("layer_types")
    if types is None and "max_window_layers" in raw and family.window_from_max_layers:
        first = int(raw["max_window_layers"])
        types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    if types is None:
        return (window,) * layers
    if len(types) != layers:
        raise ModelPathError(f"{source}: layer_types lists {len(types)} layers, the model has "
                             f"{layers}")
    known = {"sliding_attention": window, "full_attention": None}
    unknown = sorted({t for t in types if t not in known})
    if unknown:
        raise ModelPathError(f"{source}: unsupported layer_types {unknown}; supported: "
                             f"{', '.join(known)}")
    return tuple(known[t] for t in types)


def rope_from_hf(raw: Raw) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters"; older checkpoints use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:  # one rope per layer type (Gemma 3): the global layers'
        params = dict(params["full_attention"] or {})
    scaling = raw.get("rope_scaling") or {}
    params.update({k: v for k, v in scaling.items() if k not in params})
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(params.pop("rope_type", params.pop("type", "default")))
    if rope_type in ("longrope", "su"):  # Phi-3's: its lengths live at the config's top level
        rope_type = "longrope"
        for key in ("original_max_position_embeddings", "max_position_embeddings"):
            if key not in params and key in raw:
                params[key] = raw[key]
    # lists (longrope's per-frequency factors) as tuples: the config stays hashable
    items = ((k, tuple(v) if isinstance(v, list) else v) for k, v in params.items())
    return RopeConfig(theta=theta, rope_type=rope_type, params=tuple(sorted(items)))


def _mixtral(raw: Raw, layers: int) -> dict[str, Any]:
    """Every layer's MLP is a mixture; the top k are always renormalised."""
    moe = MoEConfig(int(raw["num_local_experts"]), int(raw["num_experts_per_tok"]),
                    int(raw["intermediate_size"]), True)
    return {"moe": moe, "moe_layers": (True,) * layers}


def _qwen3_moe(raw: Raw, layers: int) -> dict[str, Any]:
    """The layers not in `mlp_only_layers` and on `decoder_sparse_step` are mixtures,
    renormalised if `norm_topk_prob`."""
    # transformers 5 writes num_local_experts; Qwen3-MoE's own checkpoints num_experts
    experts = raw.get("num_experts") or raw.get("num_local_experts")
    if not experts:
        return {}
    moe = MoEConfig(int(experts), int(raw["num_experts_per_tok"]),
                    int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False)))
    dense = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step") or 1)
    return {"moe": moe, "moe_layers": tuple(i not in dense and (i + 1) % step == 0
                                            for i in range(layers))}


def _qwen2_moe(raw: Raw, layers: int) -> dict[str, Any]:
    """Qwen3-MoE's layout of mixtures, each with a shared expert every token also takes."""
    fields = _qwen3_moe(raw, layers)
    shared = int(raw.get("shared_expert_intermediate_size") or 0)
    if fields and shared:
        fields["moe"] = replace(fields["moe"], shared_intermediate_size=shared)
    return fields


def _gemma(raw: Raw, layers: int) -> dict[str, Any]:
    """Gemma 2 and 3: one set of traits; Gemma 2 soft-caps attention scores and rotates every
    layer alike, Gemma 3 gives its sliding layers their own RoPE base."""
    if raw.get("use_bidirectional_attention"):
        raise ModelPathError("use_bidirectional_attention is not supported (a causal LM only)")
    params = raw.get("rope_parameters") or {}
    if "sliding_attention" in params:  # transformers 5: one rope per layer type
        local = rope_from_hf({"rope_parameters": params["sliding_attention"]})
    elif "rope_local_base_freq" in raw:
        local = RopeConfig(theta=float(raw["rope_local_base_freq"]))
    else:  # one rope for every layer (Gemma 2)
        local = rope_from_hf(raw)
    final, attention = raw.get("final_logit_softcapping"), raw.get("attn_logit_softcapping")
    return {"gemma": GemmaTraits(float(raw.get("query_pre_attn_scalar", 256)) ** -0.5, local,
                                 float(final) if final else None,
                                 float(attention) if attention else None)}


ARCHITECTURES: dict[str, Family] = {
    "LlamaForCausalLM": Family(),
    "MistralForCausalLM": Family(),
    "Qwen2ForCausalLM": Family(attention_bias=True, window_needs_flag=True,
                               window_from_max_layers=True),
    "Qwen3ForCausalLM": Family(qk_norm=True, window_needs_flag=True),
    "Phi3ForCausalLM": Family(fused_checkpoint=True),
    "MixtralForCausalLM": Family(extra=_mixtral),
    "Qwen3MoeForCausalLM": Family(qk_norm=True, window_needs_flag=True, extra=_qwen3_moe),
    "Qwen2MoeForCausalLM": Family(attention_bias=True, window_needs_flag=True,
                                  extra=_qwen2_moe),
    "Gemma2ForCausalLM": Family(extra=_gemma),
    "Gemma3ForCausalLM": Family(qk_norm=True, extra=_gemma),
}

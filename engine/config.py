"""Frozen, validated configuration objects. Parsed once at the edge (CLI, deploy), then passed down.

This module imports no torch: the scheduler and block manager are configured from it.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUPPORTED_DTYPES = ("float32", "bfloat16")


class ModelPathError(ValueError):
    """The --model path is missing, incomplete, or holds an unsupported checkpoint."""


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"
    # The remaining rope_scaling keys (factor, low_freq_factor, ...), as a sorted tuple of pairs so
    # the dataclass stays hashable.
    params: tuple[tuple[str, Any], ...] = ()

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.params).get(key, default)


@dataclass(frozen=True)
class MoEConfig:
    """A mixture-of-experts MLP (engine.models.moe): `experts_per_token` of `num_experts`
    SwiGLU experts of `intermediate_size` each, weighted by the router's probabilities
    (renormalised over the chosen ones where `normalize_top_k`); with a shared expert of
    `shared_intermediate_size` (0: none; Qwen2-MoE) every token also gets, scaled by the sigmoid
    of its own gate."""

    num_experts: int
    experts_per_token: int
    intermediate_size: int
    normalize_top_k: bool
    shared_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.shared_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be >= 0, got "
                             f"{self.shared_intermediate_size}")
        if self.num_experts < 1 or self.intermediate_size < 1:
            raise ValueError(f"a mixture of experts needs >= 1 expert of >= 1 width, got "
                             f"{self.num_experts} of {self.intermediate_size}")
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts per token must be in [1, {self.num_experts}], got "
                             f"{self.experts_per_token}")


@dataclass(frozen=True)
class GemmaTraits:
    """What Gemma 2 and 3 do unlike Llama: RMSNorm weights used as 1 + w, a norm after attention and
    after the MLP as well as before each ("sandwich"), embeddings scaled by sqrt(hidden),
    GELU-tanh in the MLP, queries scaled by `query_pre_attn_scalar` ** -0.5, its sliding layers
    rotated with their own RoPE base (`rope_local`), and the logits optionally soft-capped."""

    attention_scale: float
    rope_local: RopeConfig
    final_logit_softcap: float | None = None
    attention_softcap: float | None = None  # Gemma 2: attention scores soft-capped


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family checkpoint, read from its config.json."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    sliding_window: int | None = None
    # Per layer, the keys a query sees: the last `w` positions (sliding-window attention), or
    # None for all of them. Empty: no layer has a window.
    layer_windows: tuple[int | None, ...] = ()
    qk_norm: bool = False  # q and k are RMS-normalised per head before RoPE (Qwen3)
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    moe: MoEConfig | None = None  # the experts of the layers whose MLP is a mixture
    moe_layers: tuple[bool, ...] = ()  # per layer: its MLP is the mixture (else dense)
    gemma: GemmaTraits | None = None  # Gemma 3's differences from Llama

    def __post_init__(self) -> None:
        from engine.architectures import ARCHITECTURES

        if self.architecture not in ARCHITECTURES:
            raise ModelPathError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(ARCHITECTURES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) < 1:
                raise ValueError(f"model config {name} must be >= 1, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})"
            )

    @property
    def release_window(self) -> int | None:
        """The widest window when every layer slides: KV before every window can be let go
        (a model with any full-attention layer keeps its whole context)."""
        windows = self.layer_windows
        if not windows or any(w is None for w in windows):
            return None
        return max(w for w in windows if w is not None)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json"
        if not config_file.is_file():
            raise ModelPathError(f"no config.json in model directory {str(path)!r}")
        raw = json.loads(config_file.read_text())
        generation = path / "generation_config.json"
        gen_raw = json.loads(generation.read_text()) if generation.is_file() else {}
        return cls.from_hf_dict(raw, gen_raw, source=str(config_file))

    @classmethod
    def from_hf_dict(
        cls, raw: dict[str, Any], gen_raw: dict[str, Any] | None = None, source: str = "config"
    ) -> ModelConfig:
        from engine.architectures import family_fields, find

        arch, family = find(raw, source)
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = _as_id_tuple((gen_raw or {}).get("eos_token_id")) + _as_id_tuple(
            raw.get("eos_token_id")
        )
        layers = int(raw["num_hidden_layers"])
        return cls(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_ids=tuple(dict.fromkeys(eos)),
            bos_token_id=raw.get("bos_token_id"),
            **family_fields(raw, family, layers, source),
        )


def _as_id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and memory budget.

    The number of blocks comes from `num_blocks` when given (tests), else from `kv_cache_gb`, else
    from `kv_cache_memory_fraction` of the memory available when the engine starts. Else, on CUDA,
    from `gpu_memory_fraction` like vLLM's gpu_memory_utilization: the engine may use that share
    of the GPU's total memory, and the KV cache gets what the weights and an activation reserve
    leave of it (engine.kv_sizing.num_kv_blocks); on CPU, `DEFAULT_KV_CACHE_GB`.
    """

    block_size: int = 16
    kv_cache_gb: float | None = None
    kv_cache_memory_fraction: float | None = None
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    shareable: bool = False  # CPU: allocate in shared memory so a peer process can map it
    gpu_memory_fraction: float = 0.9  # CUDA: share of the GPU's total memory the engine may use

    DEFAULT_KV_CACHE_GB = 1.0

    def __post_init__(self) -> None:
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size must be one of 8, 16, 32, 64, 128, got {self.block_size}")
        if self.kv_cache_gb is not None and not (0 < self.kv_cache_gb < 4096):
            raise ValueError(f"kv_cache_gb must be in (0, 4096), got {self.kv_cache_gb}")
        fraction = self.kv_cache_memory_fraction
        if fraction is not None and not (0 < fraction <= 0.95):
            raise ValueError(f"kv_cache_memory_fraction must be in (0, 0.95], got {fraction}")
        if not 0 < self.gpu_memory_fraction <= 0.95:
            raise ValueError(f"gpu_memory_fraction must be in (0, 0.95], got "
                             f"{self.gpu_memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")

    def budget_bytes(self, available_bytes: int) -> int:
        if self.kv_cache_gb is not None:
            return int(self.kv_cache_gb * 2**30)
        if self.kv_cache_memory_fraction is not None:
            return int(self.kv_cache_memory_fraction * available_bytes)
        return int(self.DEFAULT_KV_CACHE_GB * 2**30)


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits. `prefill_chunk_size` caps the prompt tokens one request gets in one step.

    512 batched tokens keep CPU matmuls near their peak while bounding how long running decodes
    wait behind a prefill chunk (measured: same offline throughput as 2048, shorter stalls).

    `queue_policy` orders prompts: "fcfs" by arrival; "short_first" fewest prompt tokens left
    first, so chat turns do not queue behind long documents (issue 16), except that a request
    older than `queue_age_bound_s` goes first, oldest first, so long prompts cannot starve."""

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 8192
    prefill_chunk_size: int | None = None
    queue_policy: str = "fcfs"
    queue_age_bound_s: float = 4.0
    # A model whose every layer slides: decoding requests let go of the blocks every window has
    # passed. Off where a request's blocks leave whole after its prompt (a prefill worker ships
    # them to a decode worker).
    release_passed_blocks: bool = True

    QUEUE_POLICIES = ("fcfs", "short_first")

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_num_seqs ({self.max_num_seqs}) so every running request can decode each step"
            )
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if self.prefill_chunk_size is not None and self.prefill_chunk_size < 1:
            raise ValueError(f"prefill_chunk_size must be >= 1, got {self.prefill_chunk_size}")
        if self.queue_policy not in self.QUEUE_POLICIES:
            raise ValueError(f"queue_policy must be one of {', '.join(self.QUEUE_POLICIES)}, "
                             f"got {self.queue_policy!r}")
        if not self.queue_age_bound_s > 0:  # written this way so NaN fails too
            raise ValueError(f"queue_age_bound_s must be > 0, got {self.queue_age_bound_s}")

    @property
    def chunk_limit(self) -> int:
        return self.prefill_chunk_size or self.max_num_batched_tokens

    # A GPU step costs about the same for 1 or 8k tokens until its matmuls fill the GPU: it wants
    # far bigger batches than 2 CPU cores (the H100 measurements used these).
    CUDA_DEFAULTS = {"max_num_batched_tokens": 8192, "max_num_seqs": 256}

    @classmethod
    def for_device(cls, device: str, **overrides: int | float | str | None) -> SchedulerConfig:
        """The defaults sized for `device` ("cpu" or "cuda[:N]"), with the given fields (those
        not None) overriding them."""
        values = dict(cls.CUDA_DEFAULTS) if device.startswith("cuda") else {}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; `model` is a local checkpoint directory or "default"."""

    model: str = "default"
    dtype: str | None = None  # None: bfloat16 where the CPU has native bf16 matmul, else float32
    device: str = "cpu"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = None  # type: ignore[assignment]  # None: for the device
    max_model_len: int | None = None
    attention_backend: str = "auto"  # auto (CUDA: triton, else torch), torch, triton, reference
    # The GPU speed paths. None: on for CUDA, off elsewhere (an H100 run proved each token-identical
    # in float32 and the three together 6.8-7.1x ours eager: BENCHMARKS.md, "GPU proof").
    # Residual + RMSNorm, RoPE and SiLU·up as fused Triton kernels (engine.models.fused); on CPU
    # they need TRITON_INTERPRET=1 (tests).
    fused_kernels: bool | None = None
    # Decode-only steps replay CUDA graphs captured at start per batch-size bucket
    # (engine.decode_graphs). CUDA only, with the triton attention backend.
    cuda_graphs: bool | None = None
    # Schedule and prepare step N+1 while step N runs on the device (LLMEngine._step_async):
    # same outputs, the host's work off the GPU's critical path.
    async_scheduling: bool | None = None
    # Ranks the model is split over (engine.tensor_parallel): one process per rank, gloo on CPU.
    # The CUDA speed paths and async scheduling are not yet supported with more than one.
    tensor_parallel_size: int = 1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"dtype must be one of {', '.join(SUPPORTED_DTYPES)}, got {self.dtype!r}"
            )
        if self.attention_backend not in ("auto", "torch", "reference", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, reference or triton, "
                f"got {self.attention_backend!r}"
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        self._resolve_speed_paths()
        self._check_tensor_parallel()
        if self.cuda_graphs and not self.device.startswith("cuda"):
            raise ValueError(f"cuda_graphs needs device cuda[:N], got device {self.device!r}")
        if self.cuda_graphs and self.attention_backend not in ("auto", "triton"):
            raise ValueError(f"cuda_graphs needs attention_backend auto or triton, got "
                             f"{self.attention_backend!r}")
        if self.scheduler is None:
            object.__setattr__(self, "scheduler", SchedulerConfig.for_device(self.device))


    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
        if size == 1:
            return
        if self.device.startswith("cuda"):
            raise ValueError("tensor_parallel_size > 1 runs on CPU ranks (gloo) only so far: "
                             "no GPU run has proved its CUDA path")
        if self.async_scheduling or self.fused_kernels or self.cuda_graphs:
            raise ValueError("tensor_parallel_size > 1 does not support async_scheduling, "
                             "fused_kernels or cuda_graphs yet")

    def _resolve_speed_paths(self) -> None:
        """Each GPU speed path left unset is on for CUDA (graphs only where triton attention
        runs), off elsewhere."""
        cuda = self.device.startswith("cuda")
        defaults = {"fused_kernels": cuda, "async_scheduling": cuda,
                    "cuda_graphs": cuda and self.attention_backend in ("auto", "triton")}
        for name, default in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, default)


def cpu_has_native_bf16() -> bool:
    """True where the CPU multiplies bf16 natively (AMX or AVX512-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return any(flag in flags.split() for flag in ("amx_bf16", "avx512_bf16"))


def default_dtype(device: str) -> str:
    if device.startswith("cuda"):
        return "bfloat16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def kv_bytes_per_block(model: ModelConfig, block_size: int, dtype_bytes: int) -> int:
    return 2 * model.num_layers * block_size * model.num_kv_heads * model.head_dim * dtype_bytes


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    return math.ceil(num_tokens / block_size)

"""The decoder layer's element-wise chains behind one small interface, in three forms.

`TorchElementwise` is the torch form: transformers' numerics (fp32 RMSNorm statistics, rounding to
the model's dtype where transformers materialises a tensor), the reference the others are tested
against. `engine.models.fused.TritonElementwise` runs each chain as one Triton kernel (CUDA, by
default there); `engine.models.cpu_elementwise.NativeCpuElementwise` as one native AVX-512 or
AVX2 kernel (CPU, wherever it builds). `select_elementwise` picks one for the model runner.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        # One fused kernel, bitwise equal to the three-op form below (checked in the tests).
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class TorchElementwise:
    """The torch form. Subclasses override the chains they fuse; `rope_qk_` rotates in place."""

    name = "torch"
    rotates_in_place = False  # rope_qkv: rotate q, k in the projection's buffer (rope_qk_)
    # A layer's closing residual add left to the next layer's add_rms_norm (its `delta`): the
    # native CPU form adds it there in the norm's pass. The torch and Triton forms keep their
    # own add (the Triton form until a GPU run shows the deferral there).
    defers_residual = False

    def add_rms_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, rms_norm(h + delta) * weight); with `delta` None, (h, rms_norm(h))."""
        if delta is not None:
            h = h + delta
        return h, rms_norm(h, weight, eps)

    def rope_qk_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """RoPE in place on qk [T, q_heads + kv_heads, D] (a view of the fused projection)."""
        qk.copy_(apply_rope(qk, cos, sin))

    def rope_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], n_heads: int,
                 n_kv: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Split the fused projection [T, (n_heads + 2 n_kv) D] into q, k, v [T, heads, D], q and
        k rotated."""
        t, q_size, kv_size = qkv.shape[0], n_heads * head_dim, n_kv * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        v = v.view(t, n_kv, head_dim)
        if not self.rotates_in_place:  # the torch form makes new q, k: no copy back
            return (apply_rope(q.view(t, n_heads, head_dim), *rope),
                    apply_rope(k.view(t, n_kv, head_dim), *rope), v)
        self.rope_qk_(qkv[:, :q_size + kv_size].view(t, n_heads + n_kv, head_dim), *rope)
        return q.view(t, n_heads, head_dim), k.view(t, n_kv, head_dim), v

    def norm_rope_qkv(self, qkv: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                      n_heads: int, n_kv: int, head_dim: int,
                      norms: tuple[torch.Tensor, torch.Tensor], eps: float
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`rope_qkv` for models that RMS-normalise each head of q and k first (Qwen3): q, k
        normalised with `norms` (q's, k's weights over head_dim), then rotated."""
        t, q_size, kv_size = qkv.shape[0], n_heads * head_dim, n_kv * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = rms_norm(q.reshape(t, n_heads, head_dim), norms[0], eps)
        k = rms_norm(k.reshape(t, n_kv, head_dim), norms[1], eps)
        return apply_rope(q, *rope), apply_rope(k, *rope), v.reshape(t, n_kv, head_dim)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 I] (gate first, as the fused weight is laid out)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


def select_elementwise(fused_kernels: bool, device: torch.device) -> TorchElementwise:
    """Triton where `fused_kernels` asks for it; on CPU the native kernels where they build; else
    the torch form."""
    if fused_kernels:
        from engine.models.fused import TritonElementwise

        return TritonElementwise()
    if device.type == "cpu":
        from engine.models.cpu_elementwise import NativeCpuElementwise, load_cpu_elementwise

        native = load_cpu_elementwise()
        if native is not None:
            return NativeCpuElementwise(native)
    return TorchElementwise()

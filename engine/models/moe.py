"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and the
token's output is their SwiGLU outputs weighted by the router's probabilities.

Three ways to run the experts, one result:
- `grouped` (the default on CPU): the (token, expert) pairs sorted by expert once, so each
  expert's rows are one contiguous slice of one gather — a pair of matmuls per expert that has
  tokens — and one scatter-add brings every weighted output back, in the order transformers sums
  them (expert by expert), so float32 output is token-identical to it;
- `loop`: the same matmuls found expert by expert (`torch.where` per expert, an add per expert):
  the reference the grouped path is measured and tested against;
- `triton` (the default on CUDA, elsewhere PDSERVE_TRITON_MOE=1; engine.models.fused_moe): the
  sorted pairs through grouped-GEMM Triton kernels, capturable in CUDA graphs — proven on one
  H100 (every MoE family token-identical to transformers, eager and with graphs).

Expert weights are stacked per layer — gate/up [E, 2 I, H] and down [E, H, I] — with I this
rank's share under tensor parallelism (each expert split like a dense MLP; the layer's
all-reduce after the MLP sums the shares), so the expert dimension stays whole and ready to be
sharded instead (expert parallelism)."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from engine.config import MoEConfig

BACKENDS = ("grouped", "loop", "triton")


def default_backend(device: torch.device) -> str:
    """On CUDA the Triton kernel: the only path CUDA graphs can capture, and 1.07-9.2x the
    grouped one's speed from 8 tokens up on one H100, eager (0.77-0.84x at one token with 8 wide
    experts, where its launches dominate and graphs take them away; BENCHMARKS.md). Elsewhere
    the grouped path, or Triton where PDSERVE_TRITON_MOE=1."""
    if device.type == "cuda" or os.environ.get("PDSERVE_TRITON_MOE") == "1":
        return "triton"
    return "grouped"


class MoEMLP:
    def __init__(self, config: MoEConfig, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, backend: str | None = None,
                 shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None):
        """`shared`: Qwen2-MoE's shared expert — gate/up [2 Is, H], down [H, Is] — and its
        gate [1, H]."""
        self.config = config
        self.router = router  # [E, H]
        self.gate_up = gate_up  # [E, 2 I, H]: gate rows, then up rows
        self.down = down  # [E, H, I]
        self.shared = shared
        self.backend = backend or default_backend(gate_up.device)
        if self.backend not in BACKENDS:
            raise ValueError(f"MoE backend must be one of {', '.join(BACKENDS)}, got "
                             f"{self.backend!r}")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        if self.backend == "loop":
            out = self.per_expert_loop(x, weights, experts)
        elif self.backend == "triton":
            from engine.models.fused_moe import fused_moe

            out = fused_moe(x, self.gate_up, self.down, weights, experts)
        else:
            out = self.grouped(x, weights, experts)
        if self.shared is None:
            return out
        gate_up, down, gate = self.shared  # as transformers: the routed sum, then the shared
        g, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return out + torch.sigmoid(F.linear(x, gate)) * F.linear(F.silu(g) * up, down)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights ([T, k] each), as transformers routes:
        softmax over every expert in float32, top k, renormalised where the model says."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.config.experts_per_token, dim=-1)
        if self.config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

    def grouped(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                ) -> torch.Tensor:
        """The pairs sorted by expert (stable: tokens in order within an expert, as the loop
        takes them), one gather, a pair of matmuls per expert on its slice; each token's rows
        then added one by one in ascending expert order, as the loop (and transformers) adds
        them — the same roundings in bfloat16 too."""
        tokens, k = experts.shape
        experts, slots = torch.sort(experts, dim=-1)
        weights = weights.gather(1, slots)
        order = torch.argsort(experts.flatten(), stable=True)
        counts = torch.bincount(experts.flatten(), minlength=self.gate_up.shape[0]).tolist()
        rows = x.index_select(0, order // k)
        outputs = torch.empty_like(rows)
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                gate, up = F.linear(rows[start:end], self.gate_up[expert]).chunk(2, dim=-1)
                outputs[start:end] = F.linear(F.silu(gate) * up, self.down[expert])
                start = end
        outputs *= weights.flatten().index_select(0, order).unsqueeze(1)
        by_token = torch.empty_like(outputs).index_copy_(0, order, outputs).view(tokens, k, -1)
        out = by_token[:, 0].clone()
        for slot in range(1, k):
            out += by_token[:, slot]
        return out

    def per_expert_loop(self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
                        ) -> torch.Tensor:
        out = torch.zeros_like(x)
        hit = torch.unique(experts).tolist()  # only experts some token chose
        for expert in hit:
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

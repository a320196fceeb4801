"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router picks each token's top-k experts, and the
token's output is their SwiGLU outputs weighted by the router's probabilities.

The CPU path here groups tokens by expert (one pair of matmuls per expert that has tokens), in the
order transformers sums them, so float32 output is token-identical to it. Expert weights are
stacked per layer — gate/up [E, 2 I, H] and down [E, H, I] — with I this rank's share under tensor
parallelism (each expert split like a dense MLP; the layer's all-reduce after the MLP sums the
shares), so the expert dimension stays whole and ready to be sharded instead (expert
parallelism)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.config import MoEConfig


class MoEMLP:
    def __init__(self, config: MoEConfig, router: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor):
        self.config = config
        self.router = router  # [E, H]
        self.gate_up = gate_up  # [E, 2 I, H]: gate rows, then up rows
        self.down = down  # [E, H, I]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        out = torch.zeros_like(x)
        hit = torch.unique(experts).tolist()  # only experts some token chose
        for expert in hit:
            token, slot = torch.where(experts == expert)
            gate, up = F.linear(x[token], self.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down[expert])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's top-k experts and their weights ([T, k] each), as transformers routes:
        softmax over every expert in float32, top k, renormalised where the model says."""
        probs = torch.softmax(F.linear(x, self.router), dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.config.experts_per_token, dim=-1)
        if self.config.normalize_top_k:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(x.dtype), experts

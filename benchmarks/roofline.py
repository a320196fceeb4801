"""Compute roofline: workload FLOPs and the matmul peak measured here at the model's shapes."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from benchmarks.common import Row


@dataclass(frozen=True)
class Shapes:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int

    @classmethod
    def from_model_config(cls, cfg: Any) -> Shapes:
        """From an engine.config.ModelConfig."""
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.num_heads,
                   cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size)

    def linears(self) -> list[tuple[str, int, int]]:
        """(name, in_features, out_features) of the fused layer matmuls, then the lm_head."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return [("qkv", self.hidden, q + 2 * kv), ("o_proj", q, self.hidden),
                ("gate_up", self.hidden, 2 * self.intermediate),
                ("down", self.intermediate, self.hidden), ("lm_head", self.hidden, self.vocab)]

    def layer_flops_per_token(self) -> int:
        """2 * the weights of every layer's matmuls (the lm_head excluded)."""
        return 2 * self.layers * sum(k * n for name, k, n in self.linears() if name != "lm_head")

    def attention_flops(self, first_pos: int, last_pos: int) -> int:
        """QK^T and PV for queries at 1-indexed positions first..last (query p reads p keys)."""
        if last_pos < first_pos:
            return 0
        positions = (first_pos + last_pos) * (last_pos - first_pos + 1) // 2
        return 4 * positions * self.heads * self.head_dim * self.layers


def workload_flops(shapes: Shapes, rows: list[Row]) -> dict[str, int]:
    """Prefill: every prompt token through the layers. Decode: every generated token but the last
    of each request is fed back through the layers. The lm_head runs once per sampled token."""
    prompt = sum(len(r["prompt_token_ids"]) for r in rows)
    output = sum(r["max_tokens"] for r in rows)
    fed_back = sum(r["max_tokens"] - 1 for r in rows)
    attn_prefill = sum(shapes.attention_flops(1, len(r["prompt_token_ids"])) for r in rows)
    attn_decode = sum(shapes.attention_flops(len(r["prompt_token_ids"]) + 1,
                                             len(r["prompt_token_ids"]) + r["max_tokens"] - 1)
                      for r in rows)
    per_token = shapes.layer_flops_per_token()
    parts = {
        "prefill_linear": prompt * per_token,
        "decode_linear": fed_back * per_token,
        "lm_head": output * 2 * shapes.hidden * shapes.vocab,
        "attention": attn_prefill + attn_decode,
    }
    parts["total"] = sum(parts.values())
    parts["output_tokens"] = output
    return parts


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up (oneDNN primitive creation, page faults)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _candidates(x: Any, w: Any) -> dict[str, Callable[[], Any]]:
    """F.linear, and oneDNN's prepacked linear with the weight blocked for M rows and for 64."""
    import torch
    import torch.nn.functional as F

    fns: dict[str, Callable[[], Any]] = {"F.linear": lambda: F.linear(x, w)}
    onednn = torch.ops.mkldnn._linear_pointwise
    for hint in dict.fromkeys((x.shape[0], 64)):
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, hint)
            onednn(x, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):
            continue  # no oneDNN prepacked linear for this dtype/build: F.linear alone
        fns[f"onednn_packed{hint}"] = partial(onednn, x, packed, None, "none", [], "")
    return fns


def _best_rate(k: int, n: int, dtype: Any, ms: tuple[int, ...], repeats: int
               ) -> tuple[float, str, dict[str, float]]:
    """Best FLOP/s at one weight shape over every M and method (each a median of repeats)."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = (torch.randn(n, k, generator=gen) * k**-0.5).to(dtype)
    rates: dict[str, float] = {}
    for m in ms:
        x = torch.randn(m, k, generator=gen).to(dtype)
        for meth, fn in _candidates(x, w).items():
            rates[f"{meth}@M={m}"] = 2 * m * k * n / _median_seconds(fn, repeats)
    best = max(rates, key=rates.__getitem__)
    return rates[best], best, rates


def measure_peak(shapes: Shapes, dtype: str, ms: tuple[int, ...] = (1024, 2048),
                 repeats: int = 5) -> dict[str, Any]:
    """Best FLOP/s per shape; peak = FLOPs of one pass over the shapes / the time that pass takes
    at each shape's best rate."""
    import torch

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    per_shape, total_flops, total_s = [], 0, 0.0
    with torch.inference_mode():
        for name, k, n in shapes.linears():
            rate, best, rates = _best_rate(k, n, torch_dtype, ms, repeats)
            per_shape.append({"shape": name, "k": k, "n": n, "best": best, "gflops": rate / 1e9,
                              "all_gflops": {key: r / 1e9 for key, r in rates.items()}})
            total_flops += 2 * k * n  # per row: M cancels out of the peak
            total_s += 2 * k * n / rate
    return {"system": "roofline", "dtype": dtype, "ms": list(ms), "repeats": repeats,
            "peak_flops": total_flops / total_s, "shapes": per_shape,
            "threads": torch.get_num_threads()}

"""Paged attention for CPU (and any device) in plain torch: batched block gather + SDPA.

Decode rows (one query each) go to the native CPU kernel (csrc/paged_decode.cpp), which reads K/V
in place through the block table; without it, they are attended in one batched SDPA call over K/V
gathered through the block table (`index_select` on rows of the flattened cache) with an additive
key-length mask. Prefill and chunked-prefill sequences are attended one by one: a prompt computed
whole in this step attends its own fresh K/V with `is_causal` (no gather at all); a chunk after a
cached prefix gathers its blocks and uses a bottom-right causal mask. On CPU with AVX-512 (fp32
also with AVX2 + FMA) both go to the native causal prefill kernel (csrc/prefill_attention.cpp:
bf16 dot products where the CPU has them; 1.7x SDPA's flash kernel in fp32 and 3.2x in bf16 on
a 256-token prompt, Zen 4; bf16 products on the AMX tiles where the CPU has those, 1.8-2.4x SDPA
there); else SDPA's flash kernel, over K/V heads expanded per query head
(`_attend_causal_sdpa`); soft-capped layers take query tiles (`_attend_prefill_tiled`). On CPU
a short chunk after a cached prefix (up to NATIVE_CHUNK_MAX queries; below
PREFILL_KERNEL_CHUNK_MIN where the prefill kernel runs) goes to the native decode kernel instead,
each query as a decode row whose length ends at its own position: that is the bottom-right
causal mask, with no gather. The plan (which rows are decodes, masks, gather indices) depends
only on the step, so `TorchPagedAttention.prepare` builds it once per step for every layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType

import torch
import torch.nn.functional as F

from engine.attention.cpu_kernel import load_cpu_kernel, load_prefill_kernel
from engine.attention.interface import write_kv_cache
from engine.native_build import cpu_has_amx_bf16

PREFILL_TILE = 128  # query rows per score tile on CPU (64-256 measured within 10%)
# Chunks of at most this many queries after a cached prefix use the native kernel on CPU. Each
# query re-reads the prefix (from cache after the first), so the gain shrinks with the chunk:
# SmolLM2 shapes, 2 threads, 512 / 2048-token prefix: 4-6x / 3.3-3.6x at 4 queries, 2.1-2.4x /
# 1.6-1.8x at 16, 1.1-1.3x at 64, and 0.7-1.1x at 256 (fp32 and bf16).
NATIVE_CHUNK_MAX = 64
# Where the native prefill kernel runs, it takes chunks of at least this many queries after a
# prefix: its tiles share each key load among 16 queries. Decode rows take 1.08-1.10x its time
# at 32 queries in fp32 (1.49-1.54x in bf16), 0.83-0.96x at 16-24 in fp32 (SmolLM2 shapes,
# 512 / 2048-token prefixes, Zen 4, 2 threads, the kernel timed with its gather of the prefix).
PREFILL_KERNEL_CHUNK_MIN = 32
# With its bf16 products on AMX tiles it takes chunks from 16 queries: decode rows took
# 1.37-1.63x its time at 16, 1.5x at 24, 1.9-2.5x at 32 and 0.87-1.02x at 8 (same shapes and
# prefixes, Xeon Emerald Rapids, 2 threads).
PREFILL_KERNEL_CHUNK_MIN_AMX = 16


@dataclass
class _Prefill:
    q_start: int
    q_end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] long
    # A short chunk after a cached prefix, as decode rows for the native kernel: the block-table
    # row once per query ([lq, num_blocks] int32) and each query's visible length ([lq] int32).
    chunk_table: torch.Tensor | None = None
    chunk_lens: torch.Tensor | None = None


def _prefill(block_table: torch.Tensor, i: int, q_start: int, q_end: int, seq_len: int,
             block_size: int) -> _Prefill:
    num_blocks = -(-seq_len // block_size)
    row = block_table[i, :num_blocks]
    lq = q_end - q_start
    if lq == seq_len or lq > NATIVE_CHUNK_MAX or row.device.type != "cpu":
        return _Prefill(q_start, q_end, seq_len, row.long())
    lens = torch.arange(seq_len - lq + 1, seq_len + 1, dtype=torch.int32, device=row.device)
    table = row.to(torch.int32).unsqueeze(0).expand(lq, num_blocks).contiguous()
    return _Prefill(q_start, q_end, seq_len, row.long(), table, lens)


@dataclass
class TorchAttentionPlan:
    decode_rows: torch.Tensor | slice | None  # rows of q that are single-token decodes
    decode_blocks: torch.Tensor | None  # [B * nb] long: the decodes' block tables, flattened
    decode_mask: torch.Tensor | None  # [B, 1, 1, nb * block_size] bool, True = attend
    prefills: list[_Prefill]
    decode_table: torch.Tensor | None = None  # [B, nb] int32, for the native kernel
    decode_lens: torch.Tensor | None = None  # [B] int32
    max_seq_len: int = 0  # the step's longest sequence (a window at least as long changes nothing)
    _additive: dict[tuple[torch.dtype, int | None], torch.Tensor] | None = None

    def additive_mask(self, dtype: torch.dtype, window: int | None = None) -> torch.Tensor:
        """The decode mask as 0 / -inf in the query dtype: SDPA's fused CPU kernel takes it
        directly, where a boolean mask costs extra conversion passes in every layer. With a
        sliding `window`, keys before the window's start are hidden too."""
        if self._additive is None:
            self._additive = {}
        key = (dtype, window)
        if key not in self._additive:
            visible = self.decode_mask
            if window is not None:
                positions = torch.arange(visible.shape[-1], device=visible.device)
                start = (self.decode_lens.long() - window).view(-1, 1, 1, 1)
                visible = visible & (positions >= start)
            zeros = torch.zeros(visible.shape, dtype=dtype, device=visible.device)
            self._additive[key] = zeros.masked_fill(~visible, float("-inf"))
        return self._additive[key]


def plan_attention(
    block_table: torch.Tensor, query_lens: list[int], seq_lens: list[int], block_size: int
) -> TorchAttentionPlan:
    device = block_table.device
    decode_idx = [i for i, n in enumerate(query_lens) if n == 1]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    prefills = [_prefill(block_table, i, starts[i], starts[i + 1], seq_lens[i], block_size)
                for i, n in enumerate(query_lens) if n != 1]
    if not decode_idx:
        return TorchAttentionPlan(None, None, None, prefills, max_seq_len=max(seq_lens))
    max_len = max(seq_lens[i] for i in decode_idx)
    num_blocks = -(-max_len // block_size)
    rows: torch.Tensor | slice
    if decode_idx == list(range(len(decode_idx))):  # the usual layout: decodes first
        rows = slice(0, len(decode_idx))
        table = block_table[: len(decode_idx), :num_blocks]
    else:
        seq_index = torch.tensor(decode_idx, device=device)
        rows = torch.tensor([starts[i] for i in decode_idx], device=device)
        table = block_table.index_select(0, seq_index)[:, :num_blocks]
    lens = torch.tensor([seq_lens[i] for i in decode_idx], dtype=torch.int32, device=device)
    positions = torch.arange(num_blocks * block_size, device=device)
    mask = (positions.unsqueeze(0) < lens.unsqueeze(1))[:, None, None, :]
    return TorchAttentionPlan(rows, table.reshape(-1).long(), mask, prefills,
                              table.contiguous(), lens, max(seq_lens))


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """[len(blocks) * block_size, n_kv, head_dim]: the blocks' slots, in table order."""
    rows = cache.view(cache.shape[0], -1).index_select(0, blocks)
    return rows.view(-1, cache.shape[2], cache.shape[3])


def run_planned_attention(
    plan: TorchAttentionPlan, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    scale: float, out: torch.Tensor,
    new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, native: ModuleType | None = None,
    window: int | None = None, softcap: float | None = None,
    native_prefill: ModuleType | None = None,
) -> torch.Tensor:
    """`window`: sliding-window attention (a query at p sees keys p - window + 1 .. p; the
    native kernels start each row at its window, reading none of the keys before it);
    `softcap`: scores become softcap * tanh(scores / softcap) before the mask (Gemma 2), which
    the native kernels do not do, so such layers take the torch paths. `native_prefill`: the
    causal prefill kernel (csrc/prefill_attention.cpp), used with `native` only."""
    if window is not None and window >= plan.max_seq_len:
        window = None  # every key of this step is inside it
    if softcap is not None:
        native = None
    prefill = native_prefill if native is not None else None
    if plan.decode_blocks is not None:
        if native is not None and q.device.type == "cpu":
            _attend_decodes_native(native, plan, q, k_cache, v_cache, scale, out, window or 0)
        else:
            _attend_decodes(plan, q, k_cache, v_cache, scale, out, window, softcap)
    if not plan.prefills:  # a decode-only step (the kernel checks cost ~25 us a layer)
        return out
    kernel_chunks = softcap is None and native_prefill_runs(prefill, q)
    chunk_min = prefill_kernel_chunk_min(prefill, q)
    for p in plan.prefills:
        if native is not None and p.chunk_table is not None and q.device.type == "cpu" and not (
                kernel_chunks and p.q_end - p.q_start >= chunk_min):
            native.paged_decode_attention(q[p.q_start:p.q_end], k_cache, v_cache, p.chunk_table,
                                          p.chunk_lens, scale, out[p.q_start:p.q_end],
                                          window or 0)
            continue
        _attend_prefill(p, q, k_cache, v_cache, scale, out, new_kv, window, softcap, prefill)
    return out


def native_prefill_runs(kernel: ModuleType | None, q: torch.Tensor) -> bool:
    """Whether the native prefill kernel takes this layer's prompts: on CPU, in a dtype its
    build supports, at head_dim 64 or 128. bfloat16 where the CPU has AMX only if the kernel's
    products run on the AMX tiles: its vdpbf16ps build took 1.4-1.6x the time of SDPA's flash
    kernel (on oneDNN's AMX GEMMs) there."""
    if kernel is None or q.device.type != "cpu" or q.shape[-1] not in (64, 128):
        return False
    if not kernel.supports(str(q.dtype).removeprefix("torch.")):
        return False
    return q.dtype != torch.bfloat16 or not cpu_has_amx_bf16() or kernel.uses_amx()


def prefill_kernel_chunk_min(kernel: ModuleType | None, q: torch.Tensor) -> int:
    """The fewest queries of a chunk after a cached prefix that the native prefill kernel
    takes (where it runs) rather than the decode kernel."""
    if q.dtype == torch.bfloat16 and kernel is not None and kernel.uses_amx():
        return PREFILL_KERNEL_CHUNK_MIN_AMX
    return PREFILL_KERNEL_CHUNK_MIN


def _attend_prefill(p: _Prefill, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    scale: float, out: torch.Tensor,
                    new_kv: tuple[torch.Tensor, torch.Tensor] | None,
                    window: int | None = None, softcap: float | None = None,
                    native_prefill: ModuleType | None = None) -> None:
    """One prompt or chunk: the native kernel, SDPA, or query tiles on CPU."""
    lq = p.q_end - p.q_start
    if lq == p.seq_len and new_kv is not None:  # whole prompt in this step: no gather
        k, v = new_kv[0][p.q_start:p.q_end], new_kv[1][p.q_start:p.q_end]
    else:
        k = _gather(k_cache, p.blocks)[: p.seq_len]
        v = _gather(v_cache, p.blocks)[: p.seq_len]
    if window is not None and window >= p.seq_len:
        window = None  # every key is inside it
    if softcap is None and native_prefill_runs(native_prefill, q):
        native_prefill.causal_prefill_attention(q[p.q_start:p.q_end], k, v, scale,
                                                out[p.q_start:p.q_end], window or 0)
        return
    k, v = k.transpose(0, 1), v.transpose(0, 1)
    if softcap is not None:  # SDPA cannot soft-cap
        _attend_prefill_tiled(q[p.q_start:p.q_end], k, v, scale, out[p.q_start:p.q_end], window,
                              softcap)
        return
    q_seq = q[p.q_start:p.q_end].transpose(0, 1)  # [H, lq, D]
    out[p.q_start:p.q_end] = _attend_causal_sdpa(q_seq, k, v, scale, window).transpose(0, 1)


def _attend_causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                        window: int | None) -> torch.Tensor:
    """[H, lq, D]: queries at the end of [n_kv, L, D] keys, bottom-right causal, through SDPA.
    On CPU the K/V heads are first expanded to one per query head: with `enable_gqa` SDPA takes
    its math path there (the whole score tensor: 1.4-2.6x slower than the expanded form),
    expanded it takes the flash kernel (tiles, online softmax): 1.02-1.23x faster than query
    tiles over bmm in fp32 and 17-24x in bf16 on a CPU without bf16 arithmetic (128-512 queries,
    512-1024 keys; AVX2 Zen 3, 2 threads, SmolLM2 shapes; benchmarks.prefill_attention_forms)."""
    lq, seq_len = q.shape[1], k.shape[1]
    gqa = {"enable_gqa": True}
    if q.device.type == "cpu" and k.shape[0] != q.shape[0]:
        group = q.shape[0] // k.shape[0]
        k, v, gqa = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0), {}
    q, k, v = q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0)
    if window is None and lq == seq_len:
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, **gqa)
    elif window is None and q.device.type != "cpu":
        # Imported here: the module imports torch._dynamo (~1.5 s), which a CPU engine never
        # needs, and every worker and engine start would pay it.
        from torch.nn.attention.bias import causal_lower_right

        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(lq, seq_len),
                                           scale=scale, **gqa)
    else:
        mask = _visible_keys(lq, seq_len, window, q.device)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, **gqa)
    return o[0]


@lru_cache(maxsize=8)
def _visible_keys(lq: int, seq_len: int, window: int | None,
                  device: torch.device) -> torch.Tensor:
    """[lq, seq_len] bool, True = attend: query i sits at position seq_len - lq + i and sees the
    keys up to it (within `window` of it, with one). Layers of a step share one."""
    q_pos = torch.arange(seq_len - lq, seq_len, device=device).unsqueeze(1)
    k_pos = torch.arange(seq_len, device=device).unsqueeze(0)
    visible = k_pos <= q_pos
    return visible if window is None else visible & (k_pos > q_pos - window)


@lru_cache(maxsize=16)
def _diagonal_mask(group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[PREFILL_TILE * group, PREFILL_TILE], 0 / -inf: the causal triangle of a tile's own keys,
    row r * group + j for query r (a tile's queries interleave the heads of a K/V group)."""
    hidden = torch.ones(PREFILL_TILE, PREFILL_TILE, dtype=torch.bool, device=device).triu_(1)
    mask = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden,
                                                                               float("-inf"))
    return mask.repeat_interleave(group, dim=0)


def _attend_prefill_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          out: torch.Tensor, window: int | None = None,
                          softcap: float | None = None) -> None:
    """Bottom-right causal attention for one sequence's queries ([lq, H, D]; k, v: [n_kv, L, D]),
    PREFILL_TILE query rows at a time, each tile against only the keys it can see, the query
    heads that share a K/V head in one matmul, the mask added to the tile's own keys only (the
    keys before them are all visible). Soft-capped layers (Gemma 2) come here because SDPA cannot
    soft-cap; against SDPA's math path (the whole [H, lq, L] score tensor, a fresh mmap in every
    layer) tiles cut the attention share of a 1.8k-token prefill from 1.4x to 0.55x the linear
    layers' time (medians of 3, 1 thread)."""
    lq, heads, head_dim = q.shape
    n_kv, seq_len = k.shape[0], k.shape[1]
    group, offset = heads // n_kv, seq_len - lq
    diagonal = _diagonal_mask(group, q.dtype, q.device)
    k, v = k.contiguous(), v.contiguous()
    # Soft-capped scores are scaled after the product, as transformers' eager path and the
    # decode path here: the scale taken into q first rounds differently where it is not a power
    # of two (Gemma 2 27B's 1/12).
    grouped = (q if softcap is not None else q * scale).reshape(lq, n_kv, group, head_dim)
    for a in range(0, lq, PREFILL_TILE):
        b = min(lq, a + PREFILL_TILE)
        rows, keys = b - a, offset + b
        q_tile = grouped[a:b].permute(1, 0, 2, 3).reshape(n_kv, rows * group, head_dim)
        scores = torch.bmm(q_tile, k[:, :keys].transpose(1, 2))
        if softcap is not None:
            scores = torch.tanh(scores * scale / softcap) * softcap
        scores[:, :, offset + a:keys] += diagonal[:rows * group, :rows]
        if window is not None and offset + b - window > 0:  # some keys fell out of the window
            q_pos = torch.arange(offset + a, offset + b, device=q.device).repeat_interleave(group)
            far = torch.arange(keys, device=q.device).unsqueeze(0) <= q_pos.unsqueeze(1) - window
            scores.masked_fill_(far.unsqueeze(0), float("-inf"))
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype)
        o = torch.bmm(probs, v[:, :keys]).view(n_kv, rows, group, head_dim)
        out[a:b] = o.permute(1, 0, 2, 3).reshape(rows, heads, head_dim)


def _attend_decodes(plan: TorchAttentionPlan, q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, scale: float, out: torch.Tensor,
                    window: int | None = None, softcap: float | None = None) -> None:
    b = plan.decode_mask.shape[0]
    n_kv, head_dim = k_cache.shape[2], k_cache.shape[3]
    k = _gather(k_cache, plan.decode_blocks).view(b, -1, n_kv, head_dim).transpose(1, 2)
    v = _gather(v_cache, plan.decode_blocks).view(b, -1, n_kv, head_dim).transpose(1, 2)
    q_dec = q[plan.decode_rows].unsqueeze(2)  # [B, H, 1, D]
    mask = plan.additive_mask(q.dtype, window)
    if softcap is None:
        o = F.scaled_dot_product_attention(q_dec, k, v, attn_mask=mask, scale=scale,
                                           enable_gqa=True)
    else:  # SDPA cannot soft-cap: the scores spelled out, as transformers' eager path does
        group = q_dec.shape[1] // n_kv
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        scores = torch.matmul(q_dec, k.transpose(2, 3)) * scale
        scores = torch.tanh(scores / softcap) * softcap + mask
        o = torch.matmul(torch.softmax(scores, -1, dtype=torch.float32).to(v.dtype), v)
    out[plan.decode_rows] = o.squeeze(2)


def _attend_decodes_native(native: ModuleType, plan: TorchAttentionPlan, q: torch.Tensor,
                           k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float,
                           out: torch.Tensor, window: int = 0) -> None:
    """The native kernel reads K/V in place through the block table: no gather copy."""
    rows = plan.decode_rows
    if isinstance(rows, slice):  # views: the kernel writes straight into `out`
        native.paged_decode_attention(q[rows], k_cache, v_cache, plan.decode_table,
                                      plan.decode_lens, scale, out[rows], window)
        return
    result = torch.empty((len(rows), *q.shape[1:]), dtype=q.dtype, device=q.device)
    native.paged_decode_attention(q[rows], k_cache, v_cache, plan.decode_table, plan.decode_lens,
                                  scale, result, window)
    out[rows] = result


class TorchPagedAttention:
    """Stateful form used by the model runner: `prepare` once per step, then call per layer."""

    takes_new_kv = True

    def __init__(self, native_decode: bool = True) -> None:
        self._plan: TorchAttentionPlan | None = None
        self._native = load_cpu_kernel() if native_decode else None
        self._native_prefill = load_prefill_kernel() if self._native is not None else None

    @property
    def uses_native_decode(self) -> bool:
        return self._native is not None

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Store this step's K/V at their slots: the native kernel's row copies on CPU, where
        each token's heads are contiguous (views of the fused projection are), else
        `write_kv_cache`'s index_copy_."""
        if self._native is not None and k.device.type == "cpu" and _heads_contiguous(k) \
                and _heads_contiguous(v) and slot_mapping.dtype == torch.int64:
            self._native.write_kv(k, v, k_cache, v_cache, slot_mapping)
        else:
            write_kv_cache(k, v, k_cache, v_cache, slot_mapping)

    def prepare(self, block_table: torch.Tensor, query_lens: list[int], seq_lens: list[int],
                block_size: int) -> None:
        self._plan = plan_attention(block_table, query_lens, seq_lens, block_size)

    def __call__(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
        block_table: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *,
        scale: float, max_query_len: int, max_seq_len: int, out: torch.Tensor | None = None,
        new_kv: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("TorchPagedAttention.prepare must be called before each step")
        out = torch.empty_like(q) if out is None else out
        return run_planned_attention(self._plan, q, k_cache, v_cache, scale, out, new_kv,
                                     self._native, window, softcap, self._native_prefill)


def _heads_contiguous(x: torch.Tensor) -> bool:
    return x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]


def paged_attention_torch(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float, max_query_len: int,
    max_seq_len: int, out: torch.Tensor | None = None, window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The stateless interface: plans from the tensors, then attends."""
    del max_query_len, max_seq_len
    starts = query_start_loc.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    plan = plan_attention(block_table, query_lens, seq_lens.tolist(), k_cache.shape[1])
    out = torch.empty_like(q) if out is None else out
    return run_planned_attention(plan, q, k_cache, v_cache, scale, out, window=window,
                                 softcap=softcap)

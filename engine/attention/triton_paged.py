"""Paged attention in Triton: one kernel for decode, chunked prefill and prefill, plus the KV write.

Program (sequence, query tile, KV head[, KV split]): BLOCK_Q query positions of one sequence times
the GROUP query heads that share one KV head, packed as the rows of one matrix, so a K/V tile read
once serves the whole group (GQA). Keys are walked in tiles of TILE_N positions, independent of the
cache's block size: every key finds its physical block through the block table. The causal mask
is bottom-right aligned (query j of a sequence with q_len queries and seq_len keys sits at
seq_len - q_len + j), every K/V load is masked by the sequence length (unused slots may hold
anything, NaN included), offsets into the cache are int64. Softmax is online, in fp32.

Long-context decode splits each sequence's keys over NUM_SPLITS programs (split-KV) that write
partial (max, sum, output) rows; a second kernel merges them.

Sliding windows (WINDOWED, `window`): a query at p sees keys p - window + 1 .. p; a query tile
starts at the first key tile any of its queries can see, so keys wholly before the window are
never read. Soft-capping (SOFTCAP, Gemma 2): scores become softcap * tanh(scores / softcap)
before the mask (tanh spelled with exp, which the interpreter has).

Under TRITON_INTERPRET=1 (CPU) the kernel runs on CPU tensors: fp32 and fp16 directly; bf16 with
UPCAST, which converts the loaded tiles to fp32 before the dot products (the interpreter's bf16
dot is wrong); on a GPU, UPCAST is off and bf16/fp16 tiles go to the tensor cores.
"""

# Triton reads kernel annotations as specialization hints: the kernels' arguments stay bare.
# ruff: noqa: ANN001

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from engine.attention.splits import MAX_SPLITS, pick_num_splits

TILE_N = 32  # keys per inner-loop tile (any multiple of 16; need not match the block size)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


# The block table's row stride is the batch's widest table: 1, a multiple of 16 or neither, each
# its own variant if specialised, and the start-up warm-up cannot foresee it.
@triton.jit(do_not_specialize=["stride_bt"])
def _attention_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_table_ptr, seq_lens_ptr, query_start_ptr,
    part_m_ptr, part_l_ptr, part_o_ptr, scale, num_tokens, num_heads,
    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    stride_ot, stride_oh, stride_bt, window, softcap,
    GROUP: tl.constexpr, GROUP_P2: tl.constexpr, BLOCK_Q: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_P2: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr,
    NUM_SPLITS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    q_tile = tl.program_id(0)  # axis 0: the only one not limited to 65535 programs
    seq = tl.program_id(1)
    kv_head = tl.program_id(2) // NUM_SPLITS
    split = tl.program_id(2) % NUM_SPLITS
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * GROUP_P2)
        q_pos = q_tile * BLOCK_Q + rows // GROUP_P2
        head = kv_head * GROUP + rows % GROUP_P2
        row_ok = (q_pos < q_len) & (rows % GROUP_P2 < GROUP)
        dims = tl.arange(0, HEAD_DIM_P2)
        dim_ok = dims < HEAD_DIM
        token = (q_start + q_pos).to(tl.int64)
        q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh
                    + dims[None, :], mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        # Keys this query tile can see at all, then this program's share of their tiles.
        kv_end = tl.minimum(seq_len, context + (q_tile + 1) * BLOCK_Q)
        first_tile = 0
        if WINDOWED:  # before the tile's first query's window: seen by none of its queries
            first_tile = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0) // TILE
        num_tiles = tl.cdiv(kv_end, TILE) - first_tile
        per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        m_i, l_i, acc = _attend_tiles(
            q, k_cache_ptr, v_cache_ptr, block_table_ptr + seq * stride_bt, seq_len,
            context + q_pos, kv_head, dims, dim_ok, first_tile + split * per_split,
            first_tile + tl.minimum(num_tiles, (split + 1) * per_split), scale, window, softcap,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            BLOCK_Q * GROUP_P2, HEAD_DIM_P2, BLOCK_SIZE, TILE, UPCAST, IEEE, WINDOWED, SOFTCAP)
        if NUM_SPLITS == 1:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh
                     + dims[None, :], out.to(out_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & dim_ok[None, :])
        else:  # partial rows [split, token, head(, dim)], merged by _merge_splits_kernel
            row = (split * num_tokens + token) * num_heads + head
            tl.store(part_m_ptr + row, m_i, mask=row_ok)
            tl.store(part_l_ptr + row, l_i, mask=row_ok)
            tl.store(part_o_ptr + row[:, None] * HEAD_DIM_P2 + dims[None, :], acc,
                     mask=row_ok[:, None])


@triton.jit
def _attend_tiles(
    q, k_cache_ptr, v_cache_ptr, table_ptr, seq_len, last_key, kv_head, dims, dim_ok,
    tile_lo, tile_hi, scale, window, softcap, stride_kb, stride_ks, stride_kh, stride_vb,
    stride_vs, stride_vh, BLOCK_M: tl.constexpr, HEAD_DIM_P2: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online softmax over key tiles [tile_lo, tile_hi): running max, sum and output rows."""
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_P2], tl.float32)
    for t in range(tile_lo, tile_hi):
        keys = t * TILE + tl.arange(0, TILE)
        key_ok = keys < seq_len
        block = tl.load(table_ptr + keys // BLOCK_SIZE, mask=key_ok, other=0).to(tl.int64)
        slot = (keys % BLOCK_SIZE).to(tl.int64)
        kv_mask = key_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + block[:, None] * stride_kb + slot[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + block[:, None] * stride_vb + slot[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        visible = key_ok[None, :] & (keys[None, :] <= last_key[:, None])
        if WINDOWED:
            visible = visible & (keys[None, :] > last_key[:, None] - window)
        qk = qk * scale
        if SOFTCAP:  # softcap * tanh(qk / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1)
            qk = softcap * (1.0 - 2.0 / (tl.exp(2.0 * qk / softcap) + 1.0))
        qk = tl.where(visible, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row that sees no key yet
        p = tl.exp(qk - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _merge_splits_kernel(part_m_ptr, part_l_ptr, part_o_ptr, out_ptr, num_tokens, num_heads,
                         stride_ot, stride_oh, HEAD_DIM: tl.constexpr,
                         HEAD_DIM_P2: tl.constexpr, NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_DIM_P2)
    row = (splits * num_tokens + token) * num_heads + head
    m = tl.load(part_m_ptr + row)
    m_max = tl.max(m, 0)
    m_max = tl.where(m_max > float("-inf"), m_max, 0.0)  # a row no program wrote
    weight = tl.exp(m - m_max)  # a split that saw no key has m = -inf: weight 0
    total = tl.sum(tl.load(part_l_ptr + row) * weight, 0)
    o = tl.load(part_o_ptr + row[:, None] * HEAD_DIM_P2 + dims[None, :])
    out = tl.sum(o * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims,
             out.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr, stride_kt, stride_kh,
                     stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_DIM_P2: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:  # a negative slot is padding: nothing to store
        dims = tl.arange(0, HEAD_DIM_P2)
        mask = dims < HEAD_DIM
        dest = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs \
            + head * stride_ch + dims
        k = tl.load(k_ptr + token * stride_kt + head * stride_kh + dims, mask=mask)
        v = tl.load(v_ptr + token * stride_vt + head * stride_vh + dims, mask=mask)
        tl.store(k_cache_ptr + dest, k, mask=mask)
        tl.store(v_cache_ptr + dest, v, mask=mask)


def _check_device(*tensors: torch.Tensor) -> None:
    if any(t.device.type == "cpu" for t in tensors) and not interpreting():
        raise RuntimeError("the Triton attention kernels run on CUDA tensors, or on CPU tensors "
                           "under TRITON_INTERPRET=1")


def _pick_splits(num_seqs: int, n_kv: int, max_query_len: int, max_seq_len: int,
                 device: torch.device) -> int:
    """Split-KV for decode when sequences x KV heads leave the GPU's SMs idle (the rule:
    engine.attention.splits)."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return pick_num_splits(num_seqs, n_kv, max_query_len, max_seq_len, sms)


def paged_attention_triton(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, *, scale: float, max_query_len: int,
    max_seq_len: int, out: torch.Tensor | None = None, num_kv_splits: int | None = None,
    upcast: bool | None = None, window: int | None = None, softcap: float | None = None,
) -> torch.Tensor:
    """The paged_attention interface (engine.attention) in Triton. `num_kv_splits` (a power of
    two) forces the split-KV path; `upcast` (default: on under the interpreter) computes the dot
    products in fp32; `window`, `softcap`: sliding-window attention and logit soft-capping."""
    _check_device(q, k_cache, v_cache)
    num_tokens, num_heads, head_dim = q.shape
    num_seqs, n_kv = seq_lens.shape[0], k_cache.shape[2]
    if num_heads % n_kv or q.stride(-1) != 1 or k_cache.stride(-1) != 1 or \
            v_cache.stride(-1) != 1:
        raise ValueError("paged_attention_triton needs heads divisible by KV heads and a "
                         "contiguous head dimension")
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    splits = num_kv_splits or _pick_splits(num_seqs, n_kv, max_query_len, max_seq_len, q.device)
    if splits & (splits - 1) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"num_kv_splits must be a power of two in [1, {MAX_SPLITS}], got "
                         f"{splits}")
    group = num_heads // n_kv
    block_q = max(1, (16 if max_query_len == 1 else 64) // triton.next_power_of_2(group))
    upcast = interpreting() if upcast is None else upcast
    grid = (triton.cdiv(max_query_len, block_q), num_seqs, n_kv * splits)
    if (window is not None and window < 1) or (softcap is not None and not softcap > 0):
        raise ValueError(f"window must be >= 1 and softcap > 0, got {window} and {softcap}")
    with _on(q.device):
        _launch(grid, q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, scale,
                splits, group, block_q, upcast, (window, softcap))
    return out


def _launch(grid: tuple[int, int, int], q: torch.Tensor, k_cache: torch.Tensor,
            v_cache: torch.Tensor, out: torch.Tensor, block_table: torch.Tensor,
            seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, splits: int,
            group: int, block_q: int, upcast: bool,
            window_softcap: tuple[int | None, float | None] = (None, None)) -> None:
    num_tokens, num_heads, head_dim = q.shape
    dim_p2 = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        # Every (split, token, head) row is written by exactly one program — a split that sees
        # no key writes max -inf and sum 0 — so the partials need no fill kernels (3 launches per
        # layer saved). Under the interpreter they start as NaN: a row left unwritten would show.
        empty = torch.full if interpreting() else torch.empty
        fill = {"fill_value": float("nan")} if interpreting() else {}
        part_m = empty((splits, num_tokens, num_heads), device=q.device, **fill)
        part_l = empty((splits, num_tokens, num_heads), device=q.device, **fill)
        part_o = empty((splits, num_tokens, num_heads, dim_p2), device=q.device, **fill)
    else:
        part_m = part_l = part_o = out  # not touched
    _attention_kernel[grid](
        q, k_cache, v_cache, out, block_table, seq_lens, query_start_loc, part_m, part_l,
        part_o, scale, num_tokens, num_heads, q.stride(0), q.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], out.stride(0), out.stride(1), block_table.stride(0),
        window_softcap[0] or 0, window_softcap[1] or 1.0,
        WINDOWED=window_softcap[0] is not None, SOFTCAP=window_softcap[1] is not None,
        GROUP=group, GROUP_P2=triton.next_power_of_2(group), BLOCK_Q=block_q,
        HEAD_DIM=head_dim, HEAD_DIM_P2=dim_p2, BLOCK_SIZE=k_cache.shape[1], TILE=TILE_N,
        NUM_SPLITS=splits, UPCAST=upcast,
        IEEE=upcast or q.dtype == torch.float32)  # fp32 math must not become TF32 on a GPU
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_m, part_l, part_o, out, num_tokens, num_heads, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, HEAD_DIM_P2=dim_p2, NUM_SPLITS=splits)


def _on(device: torch.device):  # noqa: ANN202 - a context manager
    """Triton launches on torch's current CUDA device: make it the tensors' one."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def write_kv_cache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([num_tokens, n_kv_heads, head_dim]) at `slot_mapping`'s slots
    (block * block_size + offset; negative = skip)."""
    _check_device(k, k_cache)
    if k_cache.stride() != v_cache.stride() or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("write_kv_cache_triton needs K and V caches of one layout and a "
                         "contiguous head dimension")
    num_tokens, n_kv, head_dim = k.shape
    if num_tokens == 0:
        return
    with _on(k.device):
        _write_kv_kernel[(num_tokens, n_kv)](
            k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
            v.stride(1), *k_cache.stride()[:3], BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
            HEAD_DIM_P2=triton.next_power_of_2(head_dim))


paged_attention_triton.write_kv = write_kv_cache_triton  # the backend writes K/V with it

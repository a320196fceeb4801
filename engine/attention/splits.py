"""How many programs a decode step's keys are split over (split-KV), as a pure function of the
batch's shape and the GPU's SM count, so it is tested without a GPU.

Decode attention reads every key once: it is bound by memory bandwidth only when enough programs
run at once. One program per (sequence, KV head) leaves most SMs idle for a few long sequences
(H100, 132 SMs: 16 sequences × 8 KV heads = 128 programs); splitting each sequence's keys over
more programs, merged afterwards, fills the GPU. Measured on an H100 (bf16, d128, 32/8 heads):
64×2k reached 2,885 GB/s unsplit; 16×8k went from 1,631 GB/s (auto, before) to 2,679 with 4
splits; 4×32k from 2,097 to 2,626 with 16; 1×64k stayed at ~1,310 under the former cap of 16.
The rule below picks exactly those counts and lifts the cap for one very long sequence.
"""

from __future__ import annotations

# Programs wanted per SM: ~3 resident programs hide the latency of the key loads.
PROGRAMS_PER_SM = 3
# A split shorter than this spends more on its partial row and the merge than on keys.
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 64


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _prev_power_of_2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_query_len: int, max_seq_len: int,
                    num_sms: int) -> int:
    """A power of two in [1, MAX_SPLITS]: 1 unless the step is decode-only (one query per
    sequence) and (sequences × KV heads) programs would leave SMs idle."""
    if max_query_len != 1 or num_sms < 1:
        return 1
    programs = max(1, num_seqs * num_kv_heads)
    wanted = -(-PROGRAMS_PER_SM * num_sms // programs)
    by_length = max(1, max_seq_len // MIN_KEYS_PER_SPLIT)
    return max(1, min(MAX_SPLITS, _next_power_of_2(wanted), _prev_power_of_2(by_length)))

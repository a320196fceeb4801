"""The workloads this project ships: JSON-lines request sets built by `loadtest.workloads.generate`
from text that CPython itself ships (the reference documentation in `pydoc_data.topics`), with
token ids for the default model. They live in the package, so an installed pdserve (not only a
checkout) finds them; nothing reads a file outside the project.

- offline_mixed.jsonl: 32 requests, prompts 16-480 tokens of text, outputs 16/64/256 (EOS ignored).
- online_mixed.jsonl: 240 requests, 80% chat turns (48-360 tokens, 32-256 out) and 20% long
  documents (1000-1800 tokens, 16-64 out): the mix where prefill interferes with decode.
- decode_heavy.jsonl: 128 chat turns (60-260 excerpt tokens), outputs 32-768 log-uniform (EOS
  ignored): a large batch decoding for many steps.
- shared_prefix.jsonl: 32 requests whose prompts share one ~400-token system prompt, each with its
  own question; outputs 32/64/128 (EOS ignored).
"""

from __future__ import annotations

from pathlib import Path

WORKLOAD_DIR = Path(__file__).resolve().parent
NAMES = ("offline_mixed", "online_mixed", "decode_heavy", "shared_prefix")


def workload_path(name: str) -> Path:
    """The shipped workload `name` (one of NAMES)."""
    if name not in NAMES:
        raise ValueError(f"no shipped workload {name!r}; there are {', '.join(NAMES)}")
    return WORKLOAD_DIR / f"{name}.jsonl"


OFFLINE_MIXED = workload_path("offline_mixed")
ONLINE_MIXED = workload_path("online_mixed")
DECODE_HEAVY = workload_path("decode_heavy")
SHARED_PREFIX = workload_path("shared_prefix")

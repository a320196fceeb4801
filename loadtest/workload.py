"""Prompts and output lengths of a load test, from a workload file: one JSON object per line with
`prompt_token_ids`, `max_tokens` and optionally `ignore_eos`, such as the default,
the shipped loadtest/workloads/online_mixed.jsonl (80% chat turns, 20% long documents)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from loadtest.workloads import ONLINE_MIXED

MAX_REQUESTS_LIMIT = 100_000  # requests one load test may send (--max-requests)

DEFAULT_WORKLOAD = ONLINE_MIXED


@dataclass(frozen=True)
class WorkItem:
    prompt_token_ids: list[int]
    max_tokens: int
    ignore_eos: bool
    kind: str = ""


def load_workload(path: str | Path = DEFAULT_WORKLOAD,
                  max_tokens_cap: int | None = None) -> list[WorkItem]:
    """Every row of the file; `max_tokens_cap` shortens outputs (smoke tests, tiny models)."""
    items = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not row.get("prompt_token_ids") or int(row.get("max_tokens", 0)) < 1:
            raise ValueError(f"{path}:{number}: needs non-empty prompt_token_ids and "
                             "max_tokens >= 1")
        max_tokens = int(row["max_tokens"])
        if max_tokens_cap is not None:
            max_tokens = min(max_tokens, max_tokens_cap)
        items.append(WorkItem(list(row["prompt_token_ids"]), max_tokens,
                              bool(row.get("ignore_eos", False)), str(row.get("kind", ""))))
    if not items:
        raise ValueError(f"{path}: no requests")
    return items


class WorkloadSampler:
    """Draws items at random (seeded), as independent users would."""

    def __init__(self, items: list[WorkItem], seed: int = 0):
        self.items = items
        self._rng = random.Random(seed)

    def next(self) -> WorkItem:
        return self._rng.choice(self.items)

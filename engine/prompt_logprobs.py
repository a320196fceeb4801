"""Prompt logprobs on the device: for each prompt position's row of logits, the log-probability
of the prompt token that follows it and the top k alternatives (the model's own distribution),
packed into one vector the host reads once with the step's results."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.device_tensors import to_device


@dataclass
class DevicePromptLogprobs:
    """One step's prompt logprobs, still on (or on their way from) the device."""

    counts: list[int]  # rows per scheduled item, in the runner's item order
    top_ks: list[int]  # each item's k
    targets: list[int]  # the prompt token each row predicts
    _host: torch.Tensor
    _ready: torch.cuda.Event | None = None

    def read(self) -> list[list[dict[int, float]] | None]:
        """Per item: one {token id: logprob} per row (the prompt token first), or None."""
        if self._ready is not None:
            self._ready.synchronize()
        values = self._host.tolist()
        n, top_n = len(self.targets), max(self.top_ks, default=0)
        chosen = values[:n]
        top_ids, top_values = values[n:n + n * top_n], values[n + n * top_n:]
        result: list[list[dict[int, float]] | None] = []
        row = 0
        for count, k in zip(self.counts, self.top_ks):
            entries = []
            for r in range(row, row + count):
                entry = {self.targets[r]: chosen[r]}
                for j in range(r * top_n, r * top_n + k):
                    entry.setdefault(int(top_ids[j]), top_values[j])
                entries.append(entry)
            result.append(entries or None)
            row += count
        return result


def prompt_logprobs(logits: torch.Tensor, targets: list[int], counts: list[int],
                    top_ks: list[int]) -> DevicePromptLogprobs:
    """`logits` [sum(counts), vocab] float32, one row per prompt position in item order."""
    device = logits.device
    logprobs = torch.log_softmax(logits, dim=-1)
    target = to_device(targets, torch.int64, device)
    parts = [logprobs.gather(1, target.unsqueeze(1)).squeeze(1).to(torch.float64)]
    top_n = max(top_ks, default=0)
    if top_n:
        values, ids = logprobs.topk(top_n, dim=-1)
        parts += [ids.to(torch.float64).flatten(), values.to(torch.float64).flatten()]
    packed = torch.cat(parts)
    if device.type != "cuda":
        return DevicePromptLogprobs(counts, top_ks, targets, packed)
    host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
    host.copy_(packed, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(device))
    return DevicePromptLogprobs(counts, top_ks, targets, host, ready)

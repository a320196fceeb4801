"""The only place that turns a scheduled step into tensors: builds the ragged batch, runs the model,
samples. Also owns the paged KV cache tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import CacheConfig, EngineConfig, ModelConfig, kv_bytes_per_block
from engine.loader import load_weights
from engine.models.llama import LlamaModel
from engine.sampler import Sampler, SamplingBatch
from engine.scheduler import ScheduledRequest, SchedulerOutput

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class PreparedStep:
    order: list[int]  # items[j] is SchedulerOutput.scheduled[order[j]]
    items: list[ScheduledRequest]
    input_ids: torch.Tensor
    positions: torch.Tensor
    metadata: AttentionMetadata
    logits_rows: torch.Tensor


@dataclass
class StepResult:
    sampled: list[int | None]  # one per scheduled request, in SchedulerOutput order
    logprobs: list[dict[int, float] | None]


def available_memory_bytes() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def num_kv_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                  device: torch.device) -> int:
    if cache.num_blocks is not None:
        return cache.num_blocks
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory_bytes()
    per_block = kv_bytes_per_block(model, cache.block_size, dtype.itemsize)
    blocks = cache.budget_bytes(available) // per_block
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block: one block needs {per_block} bytes "
            f"(raise kv_cache_gb or kv_cache_memory_fraction)"
        )
    return int(blocks)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 dtype: str, max_model_len: int):
        self.device = torch.device(config.device)
        self.dtype = DTYPES[dtype]
        self.block_size = config.cache.block_size
        weights = load_weights(model_path, model_config, self.dtype, self.device)
        self.model = LlamaModel(model_config, weights, max_positions=max_model_len)
        self.num_blocks = num_kv_blocks(config.cache, model_config, self.dtype, self.device)
        shape = (2, self.num_blocks, self.block_size, model_config.num_kv_heads,
                 model_config.head_dim)
        # Zero-filled so never-written slots hold finite values (the torch path masks, not skips).
        self.kv_caches = [torch.zeros(shape, dtype=self.dtype, device=self.device)
                          for _ in range(model_config.num_layers)]
        self.attention = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler()

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.run(self.prepare_inputs(out))

    def prepare_inputs(self, out: SchedulerOutput) -> PreparedStep:
        """Host-side batch preparation: the ragged batch's tensors and the attention plan."""
        # Single-token decodes first: the attention backends batch them as one block.
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens != 1)
        items = [out.scheduled[i] for i in order]
        input_ids, positions, md, logits_rows = self._prepare(items)
        self.attention.prepare(md.block_table, md.query_lens_list, md.seq_lens_list,
                               self.block_size)
        rows = torch.tensor(logits_rows, dtype=torch.int64, device=self.device)
        return PreparedStep(order, items, input_ids, positions, md, rows)

    def run(self, step: PreparedStep) -> StepResult:
        """The forward pass and sampling; results in SchedulerOutput order."""
        logits = self.model.forward(step.input_ids, step.positions, self.kv_caches, step.metadata,
                                    self.attention, step.logits_rows)
        sampling_items = [s for s in step.items if s.samples]
        batch = SamplingBatch([s.request.params for s in sampling_items],
                              [len(s.request.output_token_ids) for s in sampling_items])
        tokens, logprobs = self.sampler(logits, batch) if sampling_items else ([], [])
        sampled: list[int | None] = [None] * len(step.items)
        lps: list[dict[int, float] | None] = [None] * len(step.items)
        k = 0
        for pos, item in zip(step.order, step.items):
            if item.samples:
                sampled[pos], lps[pos] = tokens[k], logprobs[k]
                k += 1
        return StepResult(sampled, lps)

    def _prepare(self, items: list[ScheduledRequest]
                 ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_lens, seq_lens, logits_rows = [], [], []
        tables = []
        for item in items:
            request = item.request
            blocks = request.block_ids
            ids.extend(request.tokens_in(item.start, item.end))
            span = range(item.start, item.end)
            positions.extend(span)
            slots.extend(blocks[p // bs] * bs + p % bs for p in span)
            query_lens.append(item.num_tokens)
            seq_lens.append(item.end)
            tables.append(blocks[: -(-item.end // bs)])
            if item.samples:
                logits_rows.append(len(ids) - 1)
        width = max(len(t) for t in tables)
        table = [t + [0] * (width - len(t)) for t in tables]
        dev = self.device
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        md = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            block_table=torch.tensor(table, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens), max_seq_len=max(seq_lens),
            query_lens_list=query_lens, seq_lens_list=seq_lens,
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev),
                torch.tensor(positions, dtype=torch.int64, device=dev), md, logits_rows)

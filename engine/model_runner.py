"""The only place that turns a scheduled step into tensors: builds the ragged batch, runs the model,
samples. Also owns the paged KV cache tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import (
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    kv_bytes_per_block,
)
from engine.decode_graphs import DecodeGraphs, DecodeRows
from engine.device_tensors import to_device
from engine.kv_memory import allocate_kv_buffer
from engine.loader import load_weights
from engine.models.llama import LlamaModel
from engine.sampler import DeviceSamples, Sampler, SamplingBatch
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import HostBatch, batch_tensors, host_batch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class PreparedStep:
    order: list[int]  # items[j] is SchedulerOutput.scheduled[order[j]]
    items: list[ScheduledRequest]
    input_ids: torch.Tensor | None  # None when the step replays a decode graph
    positions: torch.Tensor | None
    metadata: AttentionMetadata | None
    logits_rows: torch.Tensor
    graph_bucket: int | None = None  # the decode graph this step replays (its rows are prepared)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `collect` reads it."""

    step: PreparedStep
    samples: DeviceSamples | None  # None when no request samples this step

    def sample_rows(self) -> dict[str, int]:
        """request id -> its row in `samples.tokens`."""
        sampling = [s for s in self.step.items if s.samples]
        return {s.request.request_id: k for k, s in enumerate(sampling)}


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


# Memory a CUDA process uses outside torch's caching allocator, so torch.cuda.memory_reserved
# does not count it: the CUDA context, loaded kernel modules (Triton, cuBLAS), NCCL buffers.
CUDA_OVERHEAD_BYTES = 512 * 2**20


def num_kv_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                  device: torch.device, scheduler: SchedulerConfig | None = None) -> int:
    """How many blocks the KV cache gets. Called once the weights are loaded: on CUDA (with no
    num_blocks, kv_cache_gb or kv_cache_memory_fraction) the cache gets what `gpu_memory_fraction`
    of the GPU leaves after what this process holds and an activation reserve sized for
    `scheduler` (default: SchedulerConfig()); on CPU the fixed default (1 GiB)."""
    if cache.num_blocks is not None:
        return cache.num_blocks
    per_block = kv_bytes_per_block(model, cache.block_size, dtype.itemsize)
    if (device.type == "cuda" and cache.kv_cache_gb is None
            and cache.kv_cache_memory_fraction is None):
        return _cuda_kv_blocks(cache, model, dtype, device, scheduler or SchedulerConfig(),
                               per_block)
    if device.type == "cuda":
        available = torch.cuda.mem_get_info(device)[0]
    else:
        available = available_memory_bytes()
    blocks = cache.budget_bytes(available) // per_block
    if blocks < 1:
        raise ValueError(
            f"the KV cache budget holds no block: one block needs {per_block} bytes "
            f"(raise kv_cache_gb or kv_cache_memory_fraction)"
        )
    return int(blocks)


def activation_reserve_bytes(model: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int,
                             dtype_bytes: int) -> int:
    """GPU memory one step may need beyond the weights and the KV cache, at most.

    Layers run one after another without autograd, so only one layer's tensors are alive at a
    time. Per scheduled token that is the residual stream, the normed input and the layer output
    (3 x hidden), plus the wider of the MLP (gate_up [2 x intermediate], then SiLU and the product
    [intermediate each]: 4 x intermediate) and attention (qkv, then RoPE's temporaries, the rotated
    q and the output: (heads + 2 kv_heads) x head_dim + 4 x heads x head_dim), in the model dtype;
    plus RMSNorm's fp32 copies (8 bytes x hidden). Doubled: the caching allocator rounds sizes up
    and does not always reuse freed blocks of other sizes. Logits exist only for each request's
    last token (at most min(tokens, max_num_seqs) rows): the lm_head output, its fp32 copy and the
    sampler's fp32 temporaries (softmax, noise, sorted values with int64 indices, masks, scatter)
    come to about dtype + 32 bytes per vocabulary entry.
    """
    attention = ((model.num_heads + 2 * model.num_kv_heads) * model.head_dim
                 + 4 * model.num_heads * model.head_dim)
    widest = max(4 * model.intermediate_size, attention)
    per_token = dtype_bytes * (3 * model.hidden_size + widest) + 8 * model.hidden_size
    logits_rows = min(max_num_batched_tokens, max_num_seqs)
    return (2 * max_num_batched_tokens * per_token
            + logits_rows * model.vocab_size * (dtype_bytes + 32))


def cuda_kv_budget_bytes(total: int, reserved: int, free: int, reserve: int,
                         fraction: float) -> int:
    """Bytes for the KV cache on a GPU of `total` bytes, like vLLM's gpu_memory_utilization: the
    engine may use `fraction` of the GPU's total memory; this process already holds `reserved`
    (the weights, through torch's allocator) and keeps `reserve` for activations and memory
    outside torch; the cache is never larger than the `free` memory left after that reserve
    (other processes, e.g. workers sharing this GPU, hold the rest). Never negative."""
    return max(0, min(int(fraction * total) - reserved - reserve, free - reserve))


def _cuda_kv_blocks(cache: CacheConfig, model: ModelConfig, dtype: torch.dtype,
                    device: torch.device, scheduler: SchedulerConfig, per_block: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    reserve = CUDA_OVERHEAD_BYTES + activation_reserve_bytes(
        model, scheduler.max_num_batched_tokens, scheduler.max_num_seqs, dtype.itemsize)
    budget = cuda_kv_budget_bytes(total, reserved, free, reserve, cache.gpu_memory_fraction)
    if budget < per_block:
        gib = 2**30
        raise ValueError(
            f"the KV cache budget on {device} holds no block: gpu_memory_fraction "
            f"{cache.gpu_memory_fraction} of {total / gib:.2f} GiB, minus {reserved / gib:.2f} "
            f"GiB this process holds (weights), minus a {reserve / gib:.2f} GiB activation "
            f"reserve, within {free / gib:.2f} GiB free, leaves {budget} bytes; one block needs "
            f"{per_block} bytes (raise gpu_memory_fraction, lower max_num_batched_tokens, or "
            f"set kv_cache_gb)")
    return budget // per_block


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 dtype: str, max_model_len: int):
        self.device = torch.device(config.device)
        self.dtype = DTYPES[dtype]
        self.block_size = config.cache.block_size
        weights = load_weights(model_path, model_config, self.dtype, self.device)
        if config.fused_kernels and self.device.type == "cpu" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("fused_kernels runs Triton kernels: on CUDA, or on CPU under "
                             "TRITON_INTERPRET=1")
        self.model = LlamaModel(model_config, weights, max_positions=max_model_len,
                                fused=config.fused_kernels)
        self.num_blocks = num_kv_blocks(config.cache, model_config, self.dtype, self.device,
                                        config.scheduler)
        shape = (model_config.num_layers, 2, self.num_blocks, self.block_size,
                 model_config.num_kv_heads, model_config.head_dim)
        self.kv_buffer = allocate_kv_buffer(shape, self.dtype, self.device,
                                            config.cache.shareable)
        self.kv_caches = self.kv_buffer.layers
        self.attention = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        self.graphs: DecodeGraphs | None = None
        if self.attention.name == "triton" and self.device.type == "cuda":
            self._warm_up(model_config)
        if config.cuda_graphs:
            self.enable_decode_graphs(config.scheduler.max_num_seqs, max_model_len, capture=True)

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool,
                             num_sms: int | None = None) -> None:
        """Decode-only steps of up to `max_num_seqs` sequences replay per-bucket CUDA graphs
        (engine.decode_graphs), captured now. `capture=False` runs the same static-buffer
        forwards eagerly (tests without a GPU; `num_sms` then stands for the GPU's SM count in
        the split-KV choice)."""
        if self.attention.name != "triton":
            raise ValueError(f"cuda_graphs needs the Triton attention backend, not "
                             f"{self.attention.name!r}")
        if num_sms is None:
            num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count

        def forward(ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata,
                    rows: torch.Tensor) -> torch.Tensor:
            return self.model.forward(ids, positions, self.kv_caches, md, self.attention, rows)

        graphs = DecodeGraphs(forward, max_num_seqs, max_model_len, self.block_size,
                              self.model.config.num_kv_heads, self.device, num_sms, capture)
        graphs.capture_all()
        self.graphs = graphs

    def _warm_up(self, model_config: ModelConfig) -> None:
        """Compile the attention kernels' variants now, not in the first requests."""
        from engine.attention.warmup import warm_up_attention

        warm_up_attention(model_config.num_heads, model_config.num_kv_heads,
                          model_config.head_dim, self.block_size, self.dtype, self.device)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.run(self.prepare_inputs(out))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue a step's forward and sampling without reading anything back (async
        scheduling); tokens still pending from `previous` are taken on the device."""
        step = self.prepare_inputs(out, previous)
        return LaunchedStep(step, self._forward_and_sample(step))

    def collect(self, launched: LaunchedStep) -> StepResult:
        """The step's one host read; results in SchedulerOutput order."""
        tokens, logprobs = launched.samples.read() if launched.samples else ([], [])
        step = launched.step
        sampled: list[int | None] = [None] * len(step.items)
        lps: list[dict[int, float] | None] = [None] * len(step.items)
        k = 0
        for pos, item in zip(step.order, step.items):
            if item.samples:
                sampled[pos], lps[pos] = tokens[k], logprobs[k]
                k += 1
        return StepResult(sampled, lps)

    def prepare_inputs(self, out: SchedulerOutput, previous: LaunchedStep | None = None
                       ) -> PreparedStep:
        """Host-side batch preparation: the ragged batch's tensors and the attention plan."""
        # Single-token decodes first: the attention backends batch them as one block.
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens != 1)
        items = [out.scheduled[i] for i in order]
        batch = host_batch(items, self.block_size)
        rows = to_device(batch.logits_rows, torch.int64, self.device)
        bucket = self._graph_bucket(batch)
        if bucket is not None:
            self.graphs.prepare(DecodeRows(batch.token_ids, batch.positions, batch.slots,
                                           batch.seq_lens, batch.block_tables), bucket)
            self._fill_pending(self.graphs.inputs.token_ids, batch, previous)
            return PreparedStep(order, items, None, None, None, rows, graph_bucket=bucket)
        input_ids, positions, md = batch_tensors(batch, self.device)
        self._fill_pending(input_ids, batch, previous)
        self.attention.prepare(md.block_table, md.query_lens_list, md.seq_lens_list,
                               self.block_size)
        return PreparedStep(order, items, input_ids, positions, md, rows)

    def _fill_pending(self, input_ids: torch.Tensor, batch: HostBatch,
                      previous: LaunchedStep | None) -> None:
        """Copy tokens the previous step sampled, still on the device, into this step's ids."""
        if not batch.pending:
            return
        if previous is None or previous.samples is None:
            raise RuntimeError("a pending token without the step that samples it")
        source = previous.sample_rows()
        dst = to_device([row for row, _ in batch.pending], torch.int64, self.device)
        src = to_device([source[rid] for _, rid in batch.pending], torch.int64, self.device)
        input_ids.index_copy_(0, dst, previous.samples.tokens.index_select(0, src))

    def _graph_bucket(self, batch: HostBatch) -> int | None:
        """The decode graph a step can replay: decode-only (one token per sequence) and no
        larger than the largest bucket; else None (eager)."""
        if self.graphs is None or len(batch.token_ids) != len(batch.query_lens):
            return None
        return self.graphs.bucket(len(batch.query_lens))

    def run(self, step: PreparedStep) -> StepResult:
        """The forward pass and sampling; results in SchedulerOutput order."""
        return self.collect(LaunchedStep(step, self._forward_and_sample(step)))

    def _forward_and_sample(self, step: PreparedStep) -> DeviceSamples | None:
        if step.graph_bucket is not None:
            logits = self.graphs.replay(step.graph_bucket)[step.logits_rows]
        else:
            logits = self.model.forward(step.input_ids, step.positions, self.kv_caches,
                                        step.metadata, self.attention, step.logits_rows)
        sampling_items = [s for s in step.items if s.samples]
        if not sampling_items:
            return None
        batch = SamplingBatch([s.request.params for s in sampling_items],
                              [s.request.num_output_tokens for s in sampling_items])
        return self.sampler.sample(logits, batch)

"""The only place that turns a scheduled step into tensors: builds the ragged batch, runs the model,
samples. Also owns the paged KV cache tensors."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.attention import AttentionMetadata, get_attention_backend
from engine.config import EngineConfig, ModelConfig
from engine.decode_graphs import DecodeGraphs, DecodeRows
from engine.device_tensors import to_device
from engine.kv_memory import KVShards, allocate_kv_buffer
from engine.kv_sizing import num_kv_blocks
from engine.loader import load_weights
from engine.logits_processing import RowHistory, stop_ids_for_min_tokens
from engine.models.elementwise import select_elementwise
from engine.models.llama import LlamaModel
from engine.prompt_logprobs import DevicePromptLogprobs, prompt_logprobs
from engine.request import Request
from engine.row_argmax import load_native_argmax
from engine.sampler import DeviceSamples, Sampler, SamplingBatch
from engine.scheduler import ScheduledRequest, SchedulerOutput
from engine.step_inputs import HostBatch, batch_tensors, host_batch
from engine.structured_output import GrammarBook
from engine.token_counts import TokenCounts, output_history
from engine.tp_ranks import (
    RankLauncher,
    RankSpec,
    TensorParallelRanks,
    copy_blocks,
    shard_of,
    start_ranks,
)

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
    # Async scheduling: the previous step's sampled tokens on the device and each request's row
    # there (penalties count a request's pending token too).
    previous_tokens: torch.Tensor | None = None
    previous_rows: dict[str, int] | None = None
    # Prompt logprobs: rows after the sampling rows in logits_rows (engine.step_inputs)
    prompt: HostBatch | None = None
    host: HostBatch | None = None  # an eager step's batch (what tensor-parallel ranks are sent)


@dataclass
class LaunchedStep:
    """A step whose forward and sampling are queued on the device; `collect` reads it."""

    step: PreparedStep
    samples: DeviceSamples | None  # None when no request samples this step
    prompt_logprobs: DevicePromptLogprobs | None = None
    # CUDA: recorded after the step's last kernel. `collect` waits on it even when nothing is
    # sampled (a prompt chunk): blocks freed after `collect` must not still be written.
    done: torch.cuda.Event | None = None

    def sample_rows(self) -> dict[str, int]:
        """request id -> its row in `samples.tokens`."""
        sampling = [s for s in self.step.items if s.samples]
        return {s.request.request_id: k for k, s in enumerate(sampling)}


@dataclass
class StepResult:
    sampled: list[int | None]  # one per scheduled request, in SchedulerOutput order
    logprobs: list[dict[int, float] | None]
    # per scheduled request: its chunk's prompt logprobs (Scheduler.update), where asked for
    prompt_logprobs: list[list[dict[int, float]] | None] | None = None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                 dtype: str, max_model_len: int, rank_launcher: RankLauncher | None = None):
        self.device = torch.device(config.device)
        if self.device.type == "cuda" and self.device.index is not None:
            # Events, CUDA-graph capture and Triton launches use the current device: a worker
            # on cuda:N must not run them on cuda:0.
            torch.cuda.set_device(self.device)
        self.dtype = DTYPES[dtype]
        self.block_size = config.cache.block_size
        if config.fused_kernels and self.device.type == "cpu" \
                and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("fused_kernels runs Triton kernels: on CUDA, or on CPU under "
                             "TRITON_INTERPRET=1")
        self.ranks: TensorParallelRanks | None = None  # ranks 1.. of a tensor-parallel engine
        self.model = self._build_model(config, model_config, model_path, max_model_len,
                                       rank_launcher)
        self._allocate_cache(config, model_config)
        self.attention = get_attention_backend(config.attention_backend, self.device)
        self.sampler = Sampler()
        if self.device.type == "cpu":
            load_native_argmax()  # built (or loaded from the cache) now, not in a request
        self.grammars = GrammarBook(model_path, model_config.vocab_size)
        # the penalties' token counts, per request on the device (engine.token_counts)
        self.token_counts = TokenCounts(model_config.vocab_size, self.device)
        self.graphs: DecodeGraphs | None = None
        if self.attention.name == "triton" and self.device.type == "cuda":
            self._warm_up(model_config)
            if config.fused_kernels:
                self.warm_up_model()
        if config.cuda_graphs:
            self.enable_decode_graphs(config.scheduler.max_num_seqs, max_model_len, capture=True)

    def _build_model(self, config: EngineConfig, model_config: ModelConfig, model_path: Path,
                     max_model_len: int, rank_launcher: RankLauncher | None) -> LlamaModel:
        """This process's model (rank 0's share under tensor parallelism, the other ranks
        started beside it: engine.tp_ranks) and the KV cache's size in blocks."""
        size = config.tensor_parallel_size
        shard = shard_of(model_config, 0, size) if size > 1 else None
        weights = load_weights(model_path, model_config, self.dtype, self.device, shard)
        self.num_blocks = num_kv_blocks(config.cache, model_config, self.dtype, self.device,
                                        config.scheduler, graphs=config.cuda_graphs)
        group = None
        if size > 1:
            self.ranks = start_ranks(RankSpec(
                str(model_path), model_config, self.dtype, config.device, self.block_size,
                self.num_blocks, config.attention_backend, max_model_len, size, 0,
                max(1, torch.get_num_threads() // size)), rank_launcher)
            group = self.ranks.group
        return LlamaModel(model_config, weights, max_positions=max_model_len,
                          elementwise=select_elementwise(config.fused_kernels, self.device),
                          tp=group, shard=shard)

    def _allocate_cache(self, config: EngineConfig, model_config: ModelConfig) -> None:
        """This rank's KV cache (`kv_buffer`, `kv_caches`: its layers) and `kv_shards`."""
        shard = self.model.shard
        shape = (model_config.num_layers, 2, self.num_blocks, self.block_size,
                 len(shard.kv_heads) if shard else model_config.num_kv_heads,
                 model_config.head_dim)
        self.kv_buffer = allocate_kv_buffer(shape, self.dtype, self.device,
                                            config.cache.shareable)
        self.kv_caches = self.kv_buffer.layers
        self.kv_shards = self._kv_shards(model_config)

    def _kv_shards(self, model_config: ModelConfig) -> KVShards:
        """The whole cache as the KV transports see it: ours, and every other rank's as this
        process maps it."""
        if self.ranks is None:
            return KVShards.whole(self.kv_buffer)
        size = self.ranks.size
        heads = tuple(shard_of(model_config, rank, size).kv_heads for rank in range(size))
        return KVShards((self.kv_buffer, *self.ranks.kv_buffers), heads,
                        model_config.num_kv_heads)

    def _forward(self, step: PreparedStep) -> torch.Tensor:
        """The step's logits; on CPU in the model's dtype (a bf16 [64, 49152] widening took
        0.5-2.6 ms of a decode step that picks only greedy tokens: the sampler widens them
        where it needs float32)."""
        if self.ranks is None:
            return self.model.forward(step.input_ids, step.positions, self.kv_caches,
                                      step.metadata, self.attention, step.logits_rows,
                                      float_logits=self.device.type != "cpu")
        batch = step.host  # the other ranks run their shares of this forward beside ours
        self.ranks.send(("step", batch, batch.logits_rows + batch.prompt_rows))
        try:
            return self.model.forward(step.input_ids, step.positions, self.kv_caches,
                                      step.metadata, self.attention, step.logits_rows)
        except Exception as exc:
            # The ranks may be inside a collective this rank never reached: the group is out
            # of step for good, so it stops here (the worker then goes down as a unit).
            self.ranks.break_off(f"rank 0's forward failed: {exc!r}")
            raise

    def bind_thread(self) -> None:
        """Make the calling thread's current CUDA device this runner's. A new thread starts on
        cuda:0, and Triton kernels (the fused element-wise ones, MoE) launch on the current
        device: a worker on cuda:N stepping on its own loop thread must not launch there."""
        if self.device.type == "cuda" and self.device.index is not None:
            torch.cuda.set_device(self.device)

    def broken(self) -> str | None:
        """Why this runner can never run a step again (a tensor-parallel rank is gone)."""
        return self.ranks.lost() if self.ranks is not None else None

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.ranks is not None:
            self.ranks.close()

    def enable_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool,
                             num_sms: int | None = None) -> None:
        """Decode-only steps of up to `max_num_seqs` sequences replay per-bucket CUDA graphs
        (engine.decode_graphs), captured now. `capture=False` runs the same static-buffer
        forwards eagerly (tests without a GPU; `num_sms` then stands for the GPU's SM count in
        the split-KV choice)."""
        if self.attention.name != "triton":
            raise ValueError(f"cuda_graphs needs the Triton attention backend, not "
                             f"{self.attention.name!r}")
        moe = next((layer.moe for layer in self.model.layers if layer.moe is not None), None)
        if capture and moe is not None and moe.backend != "triton":
            # the grouped and loop paths size each expert's slice on the host: not capturable
            raise ValueError(f"cuda_graphs with a mixture of experts needs the Triton MoE "
                             f"kernel (the default on CUDA), not the {moe.backend!r} path")
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
        from engine.attention.warmup import layer_kinds, warm_up_attention

        warm_up_attention(model_config.num_heads, model_config.num_kv_heads,
                          model_config.head_dim, self.block_size, self.dtype, self.device,
                          layer_kinds=layer_kinds(model_config))

    def warm_up_model(self) -> None:
        """One forward of the whole model that writes no KV (every slot -1), so the fused
        element-wise Triton kernels compile at start, not in the first request (their variants do
        not depend on the token count). Its output is garbage and dropped."""
        dev, count = self.device, min(16, self.block_size)

        def ints(values: list[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        md = AttentionMetadata(
            slot_mapping=ints([-1] * count, torch.int64), block_table=ints([[0]]),
            seq_lens=ints([count]), query_start_loc=ints([0, count]), max_query_len=count,
            max_seq_len=count, query_lens_list=[count], seq_lens_list=[count])
        self.model.forward(ints([0] * count, torch.int64), ints(list(range(count)), torch.int64),
                           self.kv_caches, md, self.attention, ints([count - 1], torch.int64))
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def execute(self, out: SchedulerOutput) -> StepResult:
        return self.run(self.prepare_inputs(out))

    def launch(self, out: SchedulerOutput, previous: LaunchedStep | None) -> LaunchedStep:
        """Queue a step's forward and sampling without reading anything back (async
        scheduling); tokens still pending from `previous` are taken on the device."""
        step = self.prepare_inputs(out, previous)
        return self._launched(step)

    def _launched(self, step: PreparedStep) -> LaunchedStep:
        samples, prompt = self._forward_and_sample(step)
        done = None
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
        return LaunchedStep(step, samples, prompt, done)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer: a forked sample's own copy
        of the block its prompt ends in (engine.forks). Done when this returns: the source block
        may be freed right after, and a peer's KV write (on its own stream, by IPC) could then
        land in it."""
        if not copies:
            return
        if self.ranks is not None and not self.ranks.kv_buffers:
            self.ranks.send(("copy", copies))  # caches this process does not map
        for buffer in self.kv_shards.buffers:  # every rank's, mapped here: done on return
            copy_blocks(buffer.tensor, copies, self.device)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def wait_idle(self) -> None:
        """Wait until every step queued on the device has run (best effort: after a failure)."""
        if self.device.type == "cuda":
            try:
                torch.cuda.synchronize(self.device)
            except RuntimeError:  # a broken device: nothing will run on it any more
                pass

    def collect(self, launched: LaunchedStep) -> StepResult:
        """The step's one host read; results in SchedulerOutput order."""
        if launched.done is not None:
            launched.done.synchronize()
        tokens, logprobs = launched.samples.read() if launched.samples else ([], [])
        step = launched.step
        sampled: list[int | None] = [None] * len(step.items)
        lps: list[dict[int, float] | None] = [None] * len(step.items)
        k = 0
        for pos, item in zip(step.order, step.items):
            if item.samples:
                sampled[pos], lps[pos] = tokens[k], logprobs[k]
                k += 1
        prompt_lps: list[list[dict[int, float]] | None] | None = None
        if launched.prompt_logprobs is not None:
            per_item = launched.prompt_logprobs.read()
            prompt_lps = [None] * len(step.items)
            for pos, entries in zip(step.order, per_item):
                prompt_lps[pos] = entries
        return StepResult(sampled, lps, prompt_lps)

    def prepare_inputs(self, out: SchedulerOutput, previous: LaunchedStep | None = None
                       ) -> PreparedStep:
        """Host-side batch preparation: the ragged batch's tensors and the attention plan."""
        # Single-token decodes first: the attention backends batch them as one block.
        order = sorted(range(len(out.scheduled)), key=lambda i: out.scheduled[i].num_tokens != 1)
        items = [out.scheduled[i] for i in order]
        batch = host_batch(items, self.block_size)
        rows = to_device(batch.logits_rows + batch.prompt_rows, torch.int64, self.device)
        bucket = self._graph_bucket(batch)
        prev_tokens = previous.samples.tokens if previous and previous.samples else None
        prev_rows = previous.sample_rows() if prev_tokens is not None else None
        if bucket is not None:
            self.graphs.prepare(DecodeRows(batch.token_ids, batch.positions, batch.slots,
                                           batch.seq_lens, batch.block_rows), bucket)
            self._fill_pending(self.graphs.inputs.token_ids, batch, previous)
            return PreparedStep(order, items, None, None, None, rows, bucket, prev_tokens,
                                prev_rows)
        input_ids, positions, md = batch_tensors(batch, self.device)
        self._fill_pending(input_ids, batch, previous)
        self.attention.prepare(md.block_table, md.query_lens_list, md.seq_lens_list,
                               self.block_size)
        return PreparedStep(order, items, input_ids, positions, md, rows, None, prev_tokens,
                            prev_rows, batch if batch.prompt_rows else None, batch)

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
        if self.graphs is None or len(batch.token_ids) != len(batch.query_lens) \
                or batch.prompt_rows:  # a graph computes only the sampling rows' logits
            return None
        return self.graphs.bucket(len(batch.query_lens))

    def run(self, step: PreparedStep) -> StepResult:
        """The forward pass and sampling; results in SchedulerOutput order."""
        return self.collect(self._launched(step))

    def _forward_and_sample(self, step: PreparedStep
                            ) -> tuple[DeviceSamples | None, DevicePromptLogprobs | None]:
        if step.graph_bucket is not None:
            logits = self.graphs.replay(step.graph_bucket)[step.logits_rows]
        else:
            logits = self._forward(step)
        sampling_items = [s for s in step.items if s.samples]
        prompt = None
        if step.prompt is not None:  # its rows follow the sampling rows
            batch = step.prompt
            prompt = prompt_logprobs(logits[len(sampling_items):].float(), batch.prompt_targets,
                                     batch.prompt_counts,
                                     [s.request.params.prompt_logprobs or 0 for s in step.items])
        if not sampling_items:
            return None, prompt
        requests = [s.request for s in sampling_items]
        batch = SamplingBatch([r.params for r in requests], [r.num_output_tokens for r in requests],
                              [self._history(r, step) for r in requests], step.previous_tokens,
                              token_counts=self.token_counts,
                              bitmask=self.grammars.bitmask([r if r.params.structured_output
                                                             else None for r in requests],
                                                            self.device))
        return self.sampler.sample(logits[:len(sampling_items)], batch), prompt

    @staticmethod
    def _history(request: Request, step: PreparedStep) -> RowHistory | None:
        """What logit processing needs of a request beyond its parameters (None: nothing)."""
        params = request.params
        if not params.processes_logits:
            return None
        pending_row = None
        if request.num_pending and params.penalizes_history:
            if step.previous_rows is None or request.request_id not in step.previous_rows:
                raise RuntimeError("a pending token without the step that samples it")
            pending_row = step.previous_rows[request.request_id]
        output = output_history(request) if params.continued_tokens else request.output_token_ids
        return RowHistory(request.prompt_token_ids, output,
                          stop_ids_for_min_tokens(params, request.eos_token_ids), pending_row,
                          request)

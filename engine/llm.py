"""Offline API: `LLM(model=...).generate(prompts, SamplingParams)` and a streaming iterator."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import LLMEngine, RequestOutput
from engine.gc_heap import heap_frozen_while
from engine.request import OutputKind, SamplingParams

Prompt = str | list[int]


class LLM:
    """Batch generation over a continuous-batching engine.

    >>> llm = LLM()  # the default SmolLM2-135M-Instruct
    >>> llm.generate(["The capital of France is"], SamplingParams(temperature=0))[0].text
    """

    def __init__(self, model: str = "default", *, dtype: str | None = None,
                 config: EngineConfig | None = None, kv_cache_gb: float | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 device: str = "cpu", tensor_parallel_size: int = 1):
        if config is None:
            sched = SchedulerConfig.for_device(device, max_num_seqs=max_num_seqs,
                                               max_num_batched_tokens=max_num_batched_tokens)
            config = EngineConfig(model=model, dtype=dtype, scheduler=sched, device=device,
                                  cache=CacheConfig(kv_cache_gb=kv_cache_gb),
                                  tensor_parallel_size=tensor_parallel_size)
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        self._batches = 0

    def _batch_prefix(self) -> str:
        self._batches += 1
        return f"batch{self._batches}"

    def generate(self, prompts: Prompt | Sequence[Prompt],
                 params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run every prompt to completion as one continuous batch; outputs in prompt order.
        Each request's steps build no output until its last (OutputKind.FINAL_ONLY, as vLLM's
        `generate` asks too), whatever kind `params` names."""
        final: dict[str, RequestOutput] = {}
        ids: list[str] = []
        for outputs in self._stream(prompts, params, ids, OutputKind.FINAL_ONLY):
            for out in outputs:
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def stream(self, prompts: Prompt | Sequence[Prompt],
               params: SamplingParams | Sequence[SamplingParams] | None = None
               ) -> Iterator[list[RequestOutput]]:
        """Yield each step's outputs (token and text deltas) until every prompt is finished."""
        return self._stream(prompts, params, [])

    def chat(self, messages: list[dict[str, str]], params: SamplingParams | None = None
             ) -> RequestOutput:
        return self.generate([self.tokenizer.encode_chat(messages)], params)[0]

    def _stream(self, prompts: Prompt | Sequence[Prompt],
                params: SamplingParams | Sequence[SamplingParams] | None,
                ids: list[str], kind: OutputKind | None = None
                ) -> Iterator[list[RequestOutput]]:
        batch = _as_prompt_list(prompts)
        per_prompt = _as_params_list(params, len(batch))
        if kind is not None:
            per_prompt = _with_output_kind(per_prompt, kind)
        engine = self.engine
        ids.extend(f"{self._batch_prefix()}-{i}" for i in range(len(batch)))
        # The whole batch is known up front, so admit the longest generations first (LPT order):
        # their long decode tails then overlap the other prompts' prefill instead of running
        # alone at the end. Outputs keep the prompts' order; no request's tokens change.
        order = sorted(range(len(batch)), key=lambda i: -per_prompt[i].max_tokens)
        try:
            for i in order:
                engine.add_request(batch[i], per_prompt[i], request_id=ids[i])
        except ValueError:
            for request_id in ids:  # leave the engine as it was
                engine.abort(request_id)
            del ids[:]
            raise
        try:
            while engine.has_unfinished_requests():
                # No full collection walks the engine's heap during a step; none is frozen
                # while the consumer holds the stream (gc_heap).
                with heap_frozen_while():
                    outputs = engine.step()
                if outputs:
                    yield outputs
        finally:
            for request_id in ids:  # a consumer that stops early must not strand blocks
                engine.abort(request_id)


def _as_prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    items = list(prompts)
    if items and all(isinstance(t, int) for t in items):
        return [items]  # one prompt given as token ids
    return items


def _as_params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int
                    ) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(n)]
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _with_output_kind(params: list[SamplingParams], kind: OutputKind) -> list[SamplingParams]:
    """`params` asking for `kind`: one copy per distinct object (a batch often shares one)."""
    copies: dict[int, SamplingParams] = {}
    for p in params:
        if id(p) not in copies:
            copies[id(p)] = p if p.output_kind is kind else dataclasses.replace(p,
                                                                                output_kind=kind)
    return [copies[id(p)] for p in params]

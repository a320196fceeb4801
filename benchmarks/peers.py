"""Peers on the same checkpoint: transformers static batching and its continuous batching."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.common import Row, check_lengths, latency_stats, summarize_runs

PAD_ID = 2
STATIC_BATCH = 16
KV_BUDGET_GIB = 1.0  # the same KV budget as the engine's default (CacheConfig.DEFAULT_KV_CACHE_GB)
RESULT_POLL_S = 5.0


def _load_model(model_dir: str, dtype: str) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch_dtype).eval()
    model.generation_config.eos_token_id = None  # run every request to its own length (ignore EOS)
    return model


class _StepClock:
    """A logits processor that only records when each decoding step's logits are ready."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        self.times.append(time.perf_counter())
        return scores


def run_hf_static(rows: list[Row], dtype: str, runs: int, model_dir: str) -> dict[str, Any]:
    """Static batches of 16 in workload order, left-padded, each run to its longest max_tokens."""
    from transformers import AutoTokenizer

    model = _load_model(model_dir, dtype)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    tokenizer.pad_token_id = PAD_ID
    _static_batch(model, tokenizer, rows[:1], max_new=4)  # warm-up
    results = []
    for _ in range(runs):
        token_times: dict[str, list[float]] = {}
        lengths: dict[str, int] = {}
        start = time.perf_counter()
        for i in range(0, len(rows), STATIC_BATCH):
            batch = rows[i:i + STATIC_BATCH]
            max_new = max(r["max_tokens"] for r in batch)
            steps, generated = _static_batch(model, tokenizer, batch, max_new)
            for r in batch:
                token_times[r["id"]] = steps[:r["max_tokens"]]
                lengths[r["id"]] = min(generated, r["max_tokens"])  # its own prefix of the batch
        elapsed = time.perf_counter() - start
        useful = sum(r["max_tokens"] for r in rows)
        results.append({"tokens": useful, "seconds": elapsed, "tok_s": useful / elapsed,
                        "latency": latency_stats(token_times, start),
                        "length_mismatches": len(check_lengths(rows, lengths))})
    return summarize_runs("hf_static", dtype, results, {"batch_size": STATIC_BATCH})


def _static_batch(model: Any, tokenizer: Any, batch: list[Row], max_new: int
                  ) -> tuple[list[float], int]:
    """One left-padded generate; returns per-step timestamps and the generated length."""
    import torch
    from transformers import GenerationConfig, LogitsProcessorList

    enc = tokenizer.pad({"input_ids": [r["prompt_token_ids"] for r in batch]},
                        padding=True, return_tensors="pt")
    config = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                              pad_token_id=PAD_ID)
    clock = _StepClock()
    with torch.inference_mode():
        out = model.generate(**enc, generation_config=config,
                             logits_processor=LogitsProcessorList([clock]))
    return clock.times, int(out.shape[1] - enc["input_ids"].shape[1])


def run_hf_cb(rows: list[Row], dtype: str, runs: int, model_dir: str, timeout_s: float
              ) -> dict[str, Any]:
    """transformers' continuous batching: every request added at once, results collected."""
    manager, info = _start_cb_manager(rows, dtype, model_dir)
    try:
        _cb_collect(manager, [{"id": "warmup", "prompt_token_ids": rows[0]["prompt_token_ids"][:32],
                               "max_tokens": 4}], timeout_s)
        results = [_cb_run_once(manager, rows, timeout_s) for _ in range(runs)]
    finally:
        manager.stop(block=True, timeout=60)
    return summarize_runs("hf_cb", dtype, results, info)


def _start_cb_manager(rows: list[Row], dtype: str, model_dir: str) -> tuple[Any, dict[str, Any]]:
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    model = _load_model(model_dir, dtype)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    page = ContinuousBatchingConfig().page_size
    bytes_per_block = (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * page
                       * model.dtype.itemsize)
    cb_config = ContinuousBatchingConfig(num_blocks=int(KV_BUDGET_GIB * 2**30 // bytes_per_block))
    hints = WorkloadHints(max_prompt_length=max(len(r["prompt_token_ids"]) for r in rows),
                          max_generated_length=max(r["max_tokens"] for r in rows),
                          num_requests=len(rows))
    gen = GenerationConfig(max_new_tokens=hints.max_generated_length, do_sample=False,
                           eos_token_id=-1, pad_token_id=PAD_ID)
    manager = model.init_continuous_batching(generation_config=gen,
                                             continuous_batching_config=cb_config,
                                             workload_hints=hints)
    manager.start()
    info = {"attn_implementation": model.config._attn_implementation,
            "cb_num_blocks": cb_config.num_blocks, "cb_page_size": page}
    return manager, info


def _cb_run_once(manager: Any, rows: list[Row], timeout_s: float) -> dict[str, Any]:
    start = time.perf_counter()
    outputs = _cb_collect(manager, rows, timeout_s)
    elapsed = time.perf_counter() - start
    useful = sum(len(o.generated_tokens) for o in outputs.values())
    times = {rid: list(o.timestamps or []) for rid, o in outputs.items()}
    lengths = {rid: len(o.generated_tokens) for rid, o in outputs.items()}
    errors = [o.error for o in outputs.values() if o.error]
    if errors:
        raise RuntimeError(f"hf_cb request failed: {errors[0]}")
    return {"tokens": useful, "seconds": elapsed, "tok_s": useful / elapsed,
            "latency": latency_stats(times, start),
            "length_mismatches": len(check_lengths(rows, lengths))}


def _cb_collect(manager: Any, rows: list[Row], timeout_s: float) -> dict[str, Any]:
    """Add every row (EOS disabled) and wait for all of them; raises after timeout_s."""
    deadline = time.perf_counter() + timeout_s
    for r in rows:
        manager.add_request(r["prompt_token_ids"], request_id=f"{r['id']}@{deadline}",
                            max_new_tokens=r["max_tokens"], eos_token_id=-1,
                            record_timestamps=True)
    done: dict[str, Any] = {}
    while len(done) < len(rows):
        if time.perf_counter() > deadline:
            raise TimeoutError(f"hf_cb: {len(rows) - len(done)} requests unfinished after "
                               f"{timeout_s:.0f}s")
        result = manager.get_result(timeout=RESULT_POLL_S)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("hf_cb generation thread stopped before all requests finished")
            continue
        if result.is_finished():
            done[result.request_id.rsplit("@", 1)[0]] = result
    return done

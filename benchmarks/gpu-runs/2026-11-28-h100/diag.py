"""Diagnostic: GEMM TFLOPS, and the top CUDA kernels of one 1B pass with every path on."""
import sys, time, torch
from pathlib import Path
from torch.profiler import ProfilerActivity, profile
sys.argv = sys.argv[:1]
for m in (256, 4096, 16384):
    a = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)
    for _ in range(3): a @ b
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(20): a @ b
    torch.cuda.synchronize(); s = (time.perf_counter() - t) / 20
    print(f"gemm {m}x4096x14336 bf16: {2*m*4096*14336/s/1e12:.0f} TFLOPS", flush=True)
from benchmarks.random_checkpoint import write_checkpoint
from benchmarks import gpu_engine as g
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.llm import LLM
from engine.request import SamplingParams
shape = "llama1b"
model_dir = write_checkpoint(shape, Path("/tmp/pdserve-cache/ckpt") / shape, Path(".gpu/tokenizer"), "cuda")
rows = g.workload(g.DEFAULT_WORKLOAD, 256)
llm = LLM(config=EngineConfig(model=str(model_dir), dtype="bfloat16", device="cuda",
          scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
          cuda_graphs=True, async_scheduling=True, fused_kernels=True))
params = [SamplingParams(temperature=0, max_tokens=r["max_tokens"], ignore_eos=True) for r in rows]
tokens = sum(r["max_tokens"] for r in rows)
for run in range(3):
    torch.cuda.synchronize(); t = time.perf_counter()
    llm.generate(g.fresh_prompts(rows, run), params)
    torch.cuda.synchronize(); s = time.perf_counter() - t
    print(f"1B all paths pass {run}: {s:.2f} s, {tokens/s:.0f} tok/s", flush=True)
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    llm.generate(g.fresh_prompts(rows, 5), params); torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))

"""Command line: `pdserve generate` (or `python -m engine generate`) and `prepare-model`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from collections.abc import Sequence

from engine.config import CacheConfig, EngineConfig, ModelPathError, SchedulerConfig
from engine.request import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by every command that builds an engine."""
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="default",
                   help="local HF Llama/Qwen2/Mistral safetensors directory, or 'default' "
                        "(SmolLM2-135M-Instruct, prepared offline)")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="default: bfloat16 where the CPU has native bf16 matmul, else float32")
    g.add_argument("--device", default="cpu")
    g.add_argument("--kv-cache-gb", type=float, default=None)
    g.add_argument("--kv-cache-memory-fraction", type=float, default=None)
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: 64 on CPU, 256 on CUDA")
    g.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: 512 on CPU, 8192 on CUDA")
    g.add_argument("--prefill-chunk-size", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None)
    on = argparse.BooleanOptionalAction  # --x / --no-x; unset: on for CUDA, off elsewhere
    g.add_argument("--fused-kernels", action=on, default=None,
                   help="fused Triton element-wise kernels (default: on for CUDA)")
    g.add_argument("--cuda-graphs", action=on, default=None,
                   help="replay decode steps from CUDA graphs (default: on for CUDA)")
    g.add_argument("--async-scheduling", action=on, default=None,
                   help="schedule step N+1 while step N runs (default: on for CUDA)")
    g.add_argument("--attention-backend", default="auto",
                   choices=["auto", "torch", "reference", "triton"])


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model, dtype=args.dtype, device=args.device,
        cache=CacheConfig(block_size=args.block_size, kv_cache_gb=args.kv_cache_gb,
                          kv_cache_memory_fraction=args.kv_cache_memory_fraction,
                          enable_prefix_caching=not args.no_prefix_caching),
        scheduler=SchedulerConfig.for_device(
            args.device, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, prefill_chunk_size=args.prefill_chunk_size),
        max_model_len=args.max_model_len, attention_backend=args.attention_backend,
        fused_kernels=args.fused_kernels, cuda_graphs=args.cuda_graphs,
        async_scheduling=args.async_scheduling,
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          stop=tuple(args.stop), ignore_eos=args.ignore_eos)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate from a prompt or a chat message, streaming")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="raw text prompt")
    source.add_argument("--chat", help="one user message, wrapped in the model's chat template")
    gen.add_argument("--system", default=None, help="system message for --chat")
    add_engine_args(gen)
    add_sampling_args(gen)
    prep = sub.add_parser("prepare-model", help="convert the shipped GGUF into the model cache")
    prep.add_argument("--force", action="store_true")
    sub.add_parser("build-kernels", help="compile the native CPU kernels (cached)")
    return parser


def run_generate(args: argparse.Namespace) -> int:
    from engine.llm import LLM

    llm = LLM(config=engine_config_from_args(args))
    params = sampling_params_from_args(args)
    if args.chat is not None:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        messages.append({"role": "user", "content": args.chat})
        prompt: str | list[int] = llm.tokenizer.encode_chat(messages)
    else:
        prompt = args.prompt
    start = time.monotonic()
    final = None
    for outputs in llm.stream(prompt, params):
        for out in outputs:
            sys.stdout.write(out.new_text)
            sys.stdout.flush()
            final = out
    elapsed = time.monotonic() - start
    if final is not None:
        n = len(final.token_ids)
        print(f"\n[{n} tokens, finish_reason={final.finish_reason}, {elapsed:.2f} s, "
              f"ttft {final.ttft_s or 0:.3f} s, dtype {llm.engine.dtype}]", file=sys.stderr)
    return 0


def build_kernels() -> int:
    """Compile (or find cached) every native CPU kernel a CPU engine loads on this machine, so
    that no engine start compiles one; 1 where one that applies here is unavailable."""
    from engine.native_kernels import build_all

    # Stopped (a background prebuild whose caller ends), unwind rather than die on the signal:
    # torch then releases its lock on the build directory, which later builds would wait on.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    kernels = build_all()
    for what, kernel in kernels.items():
        print(kernel.__file__ if kernel else
              f"native CPU {what} kernels unavailable (torch path used)")
    return 0 if all(kernels.values()) else 1


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(1)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "prepare-model":
            from engine.prepare import prepare_default_model

            print(prepare_default_model(force=args.force))
            return 0
        if args.command == "build-kernels":
            return build_kernels()
        return run_generate(args)
    except (ModelPathError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

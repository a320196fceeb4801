"""Shared prefixes: cache-aware vs load-only placement across 2 prefill workers.

    .venv/bin/python -m benchmarks.shared_prefix [--systems 4] [--system-tokens 700]
        [--chats 16] [--turns 6] [--user-tokens 120] [--max-tokens 32] [--stagger-s 1.0]
        [--placements cache-aware,load] [--json PATH] [--write]

The workload: `--systems` long system prompts shared by `--chats` conversations (chat i uses
system prompt i mod systems); each conversation runs `--turns` turns closed-loop, every turn
resending the whole history (system prompt, every user message and every reply so far) plus a
new user message; conversation i starts at i × `--stagger-s`. All text is real (token ids of
offline_mixed.jsonl, each system prompt and message its own slice). The same workload runs on a
2P+1D cluster (default model, float32, 1 thread per worker, KV cache 0.5 GB each, `--local-prefill
off` so every prompt goes through the prefill pool) once per placement. Prefill tokens computed =
Σ over requests of prompt tokens − `usage.cached_tokens` (what the prefill worker's prefix cache
held). `--write` puts the section into BENCHMARKS.md. Not a timed test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks.common import replace_marked
from benchmarks.kv_transfer import cpu_model, text_tokens
from common.grpc_server import channel
from launch.cluster import ClusterSpec, LocalCluster
from pdserve_proto import pdserve_pb2 as pb
from pdserve_proto import pdserve_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
TITLE = "## Shared prefixes: cache-aware vs load-only placement"
START, END = "<!-- shared-prefix:start -->", "<!-- shared-prefix:end -->"


@dataclass
class Turn:
    chat: int
    turn: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float = 0.0
    error: str = ""


@dataclass
class Conversation:
    system: list[int]
    users: list[list[int]]
    turns: list[Turn] = field(default_factory=list)


def build(args: argparse.Namespace) -> list[Conversation]:
    stream = text_tokens()
    cursor = 0

    def take(n: int) -> list[int]:
        nonlocal cursor
        out = [stream[(cursor + i) % len(stream)] for i in range(n)]
        cursor += n
        return out

    systems = [take(args.system_tokens) for _ in range(args.systems)]
    return [Conversation(systems[i % args.systems],
                         [take(args.user_tokens) for _ in range(args.turns)])
            for i in range(args.chats)]


def converse(address: str, chat: int, conv: Conversation, max_tokens: int) -> None:
    history = list(conv.system)
    with channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        for t, user in enumerate(conv.users):
            history += user
            turn = Turn(chat, t, len(history))
            conv.turns.append(turn)
            request = pb.GenerateRequest(
                prompt_token_ids=pb.TokenIds(ids=history),
                sampling=pb.SamplingOptions(max_tokens=max_tokens, temperature=0,
                                            ignore_eos=True))
            sent, reply = time.perf_counter(), []
            try:
                for part in stub.Generate(request, timeout=900):
                    if part.token_ids and not reply:
                        turn.ttft_s = time.perf_counter() - sent
                    reply += list(part.token_ids)
                    if part.HasField("usage"):
                        turn.cached_tokens = part.usage.cached_tokens
            except Exception as exc:  # noqa: BLE001 - recorded; the conversation ends
                turn.error = str(exc)[:200]
                return
            history += reply


def run_placement(placement: str, args: argparse.Namespace) -> tuple[list[Turn], float]:
    spec = ClusterSpec(prefill=2, decode=1, port=0, threads=1, dtype="float32", kv_cache_gb=0.5,
                       ready_timeout_s=240.0,
                       router_args=("--placement", placement, "--local-prefill", "off"))
    conversations = build(args)
    with LocalCluster(spec, Path(tempfile.mkdtemp(prefix="prefix-bench-")) / "logs") as cluster:
        started = time.perf_counter()
        threads = []
        for i, conv in enumerate(conversations):
            time.sleep(max(0.0, started + i * args.stagger_s - time.perf_counter()))
            thread = threading.Thread(target=converse, daemon=True,
                                      args=(cluster.address, i, conv, args.max_tokens))
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(timeout=3600)
        wall = time.perf_counter() - started
    turns = [t for conv in conversations for t in conv.turns]
    print(f"  {placement}: {len(turns)} turns in {wall:.0f} s", flush=True)
    return turns, wall


def least_computed(args: argparse.Namespace) -> int:
    """The fewest prompt tokens any placement could compute: each system prompt once, then per
    turn only what is new (its user message, and the previous reply, decoded elsewhere)."""
    return args.system_tokens * min(args.systems, args.chats) + args.chats * (
        args.user_tokens + (args.turns - 1) * (args.max_tokens + args.user_tokens))


def summarize(turns: list[Turn], wall_s: float) -> dict:
    ok = [t for t in turns if not t.error]
    prompt = sum(t.prompt_tokens for t in ok)
    computed = sum(t.prompt_tokens - t.cached_tokens for t in ok)
    ttfts = sorted(t.ttft_s for t in ok)
    return {"turns": len(ok), "errors": len(turns) - len(ok), "prompt_tokens": prompt,
            "computed_tokens": computed, "hit": 1 - computed / prompt if prompt else 0.0,
            "ttft_p50": statistics.median(ttfts) if ttfts else 0.0,
            "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))] if ttfts else 0.0, "wall_s": wall_s}


def section(rows: dict[str, dict], command: str, least: int) -> list[str]:
    import torch

    lines = [f"Machine: {cpu_model()}, 2 cores, CPU only, torch {torch.__version__}. One 2P+1D "
             "cluster per placement (1 thread per worker: 3 workers, the router and the client "
             "share the 2 cores).", "", f"```bash\n{command}\n```", "",
             "| placement | turns | prompt tokens | prefill tokens computed | prefix-cache hit "
             "| TTFT p50 / p90 ms | wall s | errors |", "|---" * 8 + "|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['turns']} | {r['prompt_tokens']:,} | "
                     f"{r['computed_tokens']:,} | {r['hit']:.0%} | {r['ttft_p50'] * 1e3:,.0f} / "
                     f"{r['ttft_p90'] * 1e3:,.0f} | {r['wall_s']:.0f} | {r['errors']} |")
    lines += ["", f"- The least any placement could compute: {least:,} tokens (each system prompt "
              "once; per turn, its new user message and the previous reply)."]
    if {"cache-aware", "load"} <= set(rows):
        ca, load = rows["cache-aware"], rows["load"]
        fewer = 1 - ca["computed_tokens"] / load["computed_tokens"]
        lines += [f"- Prefill tokens computed: **{fewer:.0%} fewer** with cache-aware "
                  f"placement (target ≥60%: {'met' if fewer >= 0.6 else 'not met'}).",
                  f"- TTFT p50: {ca['ttft_p50'] * 1e3:,.0f} ms cache-aware vs "
                  f"{load['ttft_p50'] * 1e3:,.0f} ms load-only (target lower: "
                  f"{'met' if ca['ttft_p50'] < load['ttft_p50'] else 'not met'})."]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    for name, default in (("systems", 4), ("system-tokens", 700), ("chats", 16), ("turns", 6),
                          ("user-tokens", 120), ("max-tokens", 32)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--stagger-s", type=float, default=1.0)
    parser.add_argument("--placements", default="cache-aware,load")
    parser.add_argument("--json", type=Path, default=None, help="raw turns here")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    rows, raw = {}, {}
    for placement in args.placements.split(","):
        turns, wall = run_placement(placement, args)
        rows[placement] = summarize(turns, wall)
        raw[placement] = [asdict(t) for t in turns]
    body = section(rows, ".venv/bin/python -m benchmarks.shared_prefix " + " ".join(sys.argv[1:]),
                   least_computed(args))
    print("\n".join(body))
    if args.json is not None:
        args.json.write_text(json.dumps({"rows": rows, "turns": raw}) + "\n")
    if args.write:
        path = ROOT / "BENCHMARKS.md"
        path.write_text(replace_section(path.read_text(), body))


def replace_section(text: str, body: list[str]) -> str:
    """`text` with this benchmark's section replaced (or appended)."""
    return replace_marked(text, body, TITLE, START, END)


if __name__ == "__main__":
    main()

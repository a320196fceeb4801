"""The report of benchmarks.served_vs_vllm: medians per system and rate over the runs, the
tables (p50s, p90s, ratios to vLLM), what went wrong, and the BENCHMARKS.md section."""

from __future__ import annotations

import argparse
import statistics
from typing import Any

LABELS = {"vllm": "vLLM", "ours_colocated": "ours colocated", "ours_1p1d": "ours 1P+1D",
          "ours_colocated_512": "ours colocated, budget 512"}
INPUT_LEN, OUTPUT_LEN = 256, 128
# (result key, column heading) of every figure reported, medians over runs.
FIGURES = (("request_throughput", "req/s"), ("median_ttft_ms", "TTFT p50 ms"),
           ("p90_ttft_ms", "TTFT p90 ms"), ("median_itl_ms", "ITL p50 ms"),
           ("p90_itl_ms", "ITL p90 ms"), ("output_throughput", "output tok/s"),
           ("median_tpot_ms", "TPOT p50 ms"))


def rate_text(rate: float) -> str:
    return f"{rate:g}"


def summarize(records: list[dict[str, Any]]) -> dict[tuple[str, float], dict[str, Any]]:
    """Per (system, rate): the median of each figure over the runs that produced a result, and
    what went wrong (failed runs and requests, wrong output lengths, distinct errors)."""
    groups: dict[tuple[str, float], list[dict[str, Any]]] = {}
    for record in records:
        groups.setdefault((record["system"], record["rate"]), []).append(record)
    summary = {}
    for key, group in groups.items():
        done = [r["result"] for r in group if "result" in r]
        figures: dict[str, Any] = {k: statistics.median(res[k] for res in done)
                                   for k, _ in FIGURES if done and all(k in res for res in done)}
        figures.update(
            runs=len(done), failed_runs=len(group) - len(done),
            failed_requests=sum(res.get("failed", 0) for res in done),
            output_len_mismatches=sum(res.get("output_len_mismatches", 0) for res in done),
            chunks_per_request=max((res.get("chunks_per_request") or 0 for res in done),
                                   default=0),
            errors=sorted({e for res in done for e in res.get("errors", [])}
                          | {r["error"] for r in group if "error" in r}))
        summary[key] = figures
    return summary


def _cell(figures: dict[str, Any] | None, keys: tuple[str, ...]) -> str:
    if not figures or not all(k in figures for k in keys):
        return "failed" if figures else "—"
    parts = [f"{figures[k]:,.2f}" if k == "request_throughput" else f"{figures[k]:,.1f}"
             for k in keys]
    flag = " ⚠" if figures["failed_requests"] or figures["failed_runs"] else ""
    return ", ".join(parts) + flag


def _ratio_cell(ours: dict[str, Any] | None, peer: dict[str, Any] | None) -> str:
    """Ours' achieved req/s ÷ vLLM's; vLLM's TTFT and ITL ÷ ours' (> 1: ours faster)."""
    keys = ("request_throughput", "median_ttft_ms", "median_itl_ms")
    if not ours or not peer or not all(k in ours and k in peer for k in keys):
        return "—"
    ratios = [ours[keys[0]] / peer[keys[0]]] + [peer[k] / ours[k] if ours[k] else float("nan")
                                                for k in keys[1:]]
    return ", ".join(f"{r:.2f}×" for r in ratios)


def tables(summary: dict[tuple[str, float], dict[str, Any]], systems: list[str],
           rates: list[float]) -> list[str]:
    main_keys = ("request_throughput", "median_ttft_ms", "median_itl_ms")
    tail_keys = ("p90_ttft_ms", "p90_itl_ms", "output_throughput")
    heads = [f"{LABELS[s]}: req/s, TTFT p50, ITL p50" if i == 0 else LABELS[s]
             for i, s in enumerate(systems)]
    lines = ["| offered req/s | " + " | ".join(heads) + " |",
             "|---" * (len(systems) + 1) + "|"]
    lines += [f"| {rate_text(r)} | " + " | ".join(_cell(summary.get((s, r)), main_keys)
                                                  for s in systems) + " |" for r in rates]
    heads = [f"{LABELS[s]}: TTFT p90, ITL p90, output tok/s" if i == 0 else LABELS[s]
             for i, s in enumerate(systems)]
    lines += ["", "| offered req/s | " + " | ".join(heads) + " |",
              "|---" * (len(systems) + 1) + "|"]
    lines += [f"| {rate_text(r)} | " + " | ".join(_cell(summary.get((s, r)), tail_keys)
                                                  for s in systems) + " |" for r in rates]
    ours = [s for s in systems if s != "vllm"]
    if "vllm" in systems and ours:
        heads = [f"{LABELS[s]} vs vLLM: req/s, TTFT, ITL" for s in ours]
        lines += ["", "| offered req/s | " + " | ".join(heads) + " |",
                  "|---" * (len(ours) + 1) + "|"]
        lines += [f"| {rate_text(r)} | " + " | ".join(
            _ratio_cell(summary.get((s, r)), summary.get(("vllm", r))) for s in ours) + " |"
                  for r in rates]
    return lines


def problems(summary: dict[tuple[str, float], dict[str, Any]]) -> list[str]:
    """A line per (system, rate) where something failed, and the distinct errors."""
    lines = []
    for (system, rate), f in sorted(summary.items()):
        if f["failed_runs"] or f["failed_requests"] or f["output_len_mismatches"]:
            lines.append(f"- ⚠ {LABELS[system]} at {rate_text(rate)} req/s: {f['failed_runs']} "
                         f"failed runs, {f['failed_requests']} failed requests, "
                         f"{f['output_len_mismatches']} outputs not {OUTPUT_LEN} tokens long")
            lines += [f"  - `{e.strip().splitlines()[-1][:300]}`" for e in f["errors"] if e]
    return lines


def chunk_notes(summary: dict[tuple[str, float], dict[str, Any]]) -> list[str]:
    """Systems whose streams carry more chunks with `choices` than tokens: the client takes
    every such chunk for a token, so each extra one adds a gap to ITL (and moves the end of
    the request, which TPOT divides by OUTPUT_LEN - 1)."""
    extra = sorted({(s, f["chunks_per_request"]) for (s, _), f in summary.items()
                    if f["chunks_per_request"] > OUTPUT_LEN})
    return [f"- {LABELS[s]}: {n:g} stream chunks with `choices` per {OUTPUT_LEN}-token "
            f"request (median), so vLLM's client records {n - 1:g} ITL gaps instead of "
            f"{OUTPUT_LEN - 1}; a chunk with a finish reason and no text adds a gap of ≈ 0 ms."
            for s, n in extra]


def section(records: list[dict[str, Any]], args: argparse.Namespace, meta: dict[str, Any],
            command: str) -> list[str]:
    summary = summarize(records)
    lines = [f"Machine: {meta['cpu']}, {meta['cores']} cores, CPU only; {meta['versions']}; "
             f"{args.dtype}; model `{meta['model']}`. {meta['date']}.", "",
             f"```bash\n{command}\n```", "",
             f"`vllm bench serve` (vLLM's own client) loads each server: {args.num_prompts} "
             f"random prompts of {INPUT_LEN} tokens per rate, {OUTPUT_LEN} output tokens (EOS "
             "ignored, temperature 0), Poisson arrivals, a fresh seed per rate and run. vLLM: "
             "`vllm serve` with its defaults, its worker bound to every core "
             f"(VLLM_CPU_OMP_THREADS_BIND={meta['omp_bind']}, VLLM_CPU_KVCACHE_SPACE="
             f"{meta['kv_gib']} GiB); ours: `router launch --colocated 1 --threads 2` and "
             "`router launch --prefill 1 --decode 1 --threads 1` (KV cache: the engine's default). "
             "Servers and client share the cores; one server at a time, the order alternating "
             f"between runs; medians over {args.runs} run{'s' * (args.runs != 1)} (one server "
             "start each, one warm-up request). ITL: vLLM's, every gap between stream chunks; "
             "ms unless noted.", "",
             *tables(summary, args.systems, args.rates), ""]
    if "vllm" in args.systems and len(args.systems) > 1:
        lines += ["Ratios: ours' achieved req/s ÷ vLLM's; vLLM's TTFT p50 and ITL p50 ÷ ours' "
                  "(above 1: ours faster).", ""]
    complete = [f"Every request of every run completed with {OUTPUT_LEN} output tokens."
                if any("result" in r for r in records) else "No run produced a result."]
    lines += problems(summary) or complete
    lines += chunk_notes(summary)
    return lines


def cpu_description(lscpu: str) -> str:
    """`lscpu`'s model name and its AVX-512 and AMX flags (what the CPU kernels of both
    systems pick their paths by)."""
    fields = dict((k.strip(), v.strip()) for k, v in
                  (line.split(":", 1) for line in lscpu.splitlines() if ":" in line))
    flags = fields.get("Flags", "").split()
    avx512 = [f for f in flags if f.startswith("avx512")]
    amx = [f for f in flags if f.startswith("amx")]
    return (f"{fields.get('Model name', 'unknown CPU')} (AVX-512: {' '.join(avx512) or 'none'}; "
            f"AMX: {' '.join(amx) or 'none'})")
